// The few CUDA driver API types and entry points tidekv uses, declared here so that no CUDA
// toolkit is needed to build: the driver (libcuda.so.1) is loaded at run time by driver.cpp.
// Values and layouts are those of cuda.h (stable across CUDA 11-13 for everything below).
#pragma once

#include <cstddef>
#include <cstdint>

namespace tidekv::cuda {

using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;
using CUcontext = struct CUctx_st*;
using CUstream = struct CUstream_st*;
using CUevent = struct CUevent_st*;
using CUmemGenericAllocationHandle = unsigned long long;

constexpr CUresult CUDA_SUCCESS = 0;
constexpr CUresult CUDA_ERROR_INVALID_VALUE = 1;
constexpr CUresult CUDA_ERROR_NOT_READY = 600;

struct CUipcMemHandle {
  char reserved[64];
};

// CUpointer_attribute
constexpr int CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2;
constexpr int CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9;
// CUmemorytype
constexpr unsigned CU_MEMORYTYPE_HOST = 1;
constexpr unsigned CU_MEMORYTYPE_DEVICE = 2;
constexpr unsigned CU_MEMORYTYPE_UNIFIED = 4;
// flags
constexpr unsigned CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1;
constexpr unsigned CU_STREAM_NON_BLOCKING = 1;
constexpr unsigned CU_EVENT_DISABLE_TIMING = 2;
constexpr unsigned CU_MEMHOSTALLOC_PORTABLE = 1;
// CUmemAllocationHandleType, CUmemLocationType, CUmemAccess_flags
constexpr int CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1;
constexpr int CU_MEM_LOCATION_TYPE_DEVICE = 1;
constexpr int CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3;
// CUdevice_attribute
constexpr int CU_DEVICE_ATTRIBUTE_PCI_BUS_ID = 33;
constexpr int CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102;

struct CUmemLocation {
  int type;
  int id;
};

struct CUmemAllocationProp {
  int type;
  int requestedHandleTypes;
  CUmemLocation location;
  void* win32HandleMetaData;
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
};
static_assert(sizeof(CUmemAllocationProp) == 32);

struct CUmemAccessDesc {
  CUmemLocation location;
  int flags;
};

// The driver's entry points, by the symbol names libcuda.so.1 exports (the _v2 ones where the
// plain name is the legacy 32-bit variant).
struct Api {
  CUresult (*cuInit)(unsigned);
  CUresult (*cuGetErrorString)(CUresult, const char**);
  CUresult (*cuDriverGetVersion)(int*);
  CUresult (*cuDeviceGetCount)(int*);
  CUresult (*cuDeviceGet)(CUdevice*, int);
  CUresult (*cuDeviceGetName)(char*, int, CUdevice);
  CUresult (*cuDeviceGetAttribute)(int*, int, CUdevice);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*cuCtxPushCurrent)(CUcontext);  // _v2
  CUresult (*cuCtxPopCurrent)(CUcontext*);  // _v2
  CUresult (*cuPointerGetAttribute)(void*, int, CUdeviceptr);
  CUresult (*cuMemGetAddressRange)(CUdeviceptr*, size_t*, CUdeviceptr);  // _v2
  CUresult (*cuIpcGetMemHandle)(CUipcMemHandle*, CUdeviceptr);
  CUresult (*cuIpcOpenMemHandle)(CUdeviceptr*, CUipcMemHandle, unsigned);  // _v2
  CUresult (*cuIpcCloseMemHandle)(CUdeviceptr);
  CUresult (*cuMemRetainAllocationHandle)(CUmemGenericAllocationHandle*, void*);
  CUresult (*cuMemGetAllocationPropertiesFromHandle)(CUmemAllocationProp*, CUmemGenericAllocationHandle);
  CUresult (*cuMemExportToShareableHandle)(void*, CUmemGenericAllocationHandle, int, unsigned long long);
  CUresult (*cuMemImportFromShareableHandle)(CUmemGenericAllocationHandle*, void*, int);
  CUresult (*cuMemAddressReserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long);
  CUresult (*cuMemAddressFree)(CUdeviceptr, size_t);
  CUresult (*cuMemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
  CUresult (*cuMemUnmap)(CUdeviceptr, size_t);
  CUresult (*cuMemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t);
  CUresult (*cuMemRelease)(CUmemGenericAllocationHandle);
  CUresult (*cuStreamCreate)(CUstream*, unsigned);
  CUresult (*cuStreamSynchronize)(CUstream);
  CUresult (*cuMemcpyAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
  CUresult (*cuMemHostAlloc)(void**, size_t, unsigned);
  CUresult (*cuMemFreeHost)(void*);
  CUresult (*cuEventCreate)(CUevent*, unsigned);
  CUresult (*cuEventRecord)(CUevent, CUstream);
  CUresult (*cuEventSynchronize)(CUevent);
  CUresult (*cuEventDestroy)(CUevent);  // _v2
};

}  // namespace tidekv::cuda
