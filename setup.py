"""Build glue for the private native module `tidekv._native` (C++17, pybind11) and for
`libtransfer_engine.so`, the Mooncake-compatible C API of plugins/trtllm (TensorRT-LLM's MOONCAKE
cache transceiver loads it by that name; `tidekv trtllm-lib` prints where it is).

Everything else lives in pyproject.toml; setuptools needs code to describe an extension.
"""
import os
import shutil
from glob import glob

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

ParallelCompile("TIDEKV_BUILD_JOBS", default=0).install()

COMPILE_ARGS = ["-O2", "-g0", "-fvisibility=hidden", "-Wall", "-Wextra", "-Wno-unused-parameter"]
LINK_ARGS = ["-pthread", "-ldl"]  # -ldl: dlopen of libcuda on glibc < 2.34

# The extension exports PyInit__native alone. Where a toolchain links libstdc++ statically (the
# GPU hosts' image does), its locale facets' ids would otherwise be exported as unique symbols
# that the loader binds every later library to: `import torch` after a TransferEngine existed
# then crashed in torch's first ostream insert (H200, 2026-12-04).
EXTENSION_MAP = "native/extension.map"

native = Pybind11Extension(
    "tidekv._native",
    sorted(glob("native/**/*.cpp", recursive=True)),
    include_dirs=["native"],
    cxx_std=17,
    extra_compile_args=COMPILE_ARGS,
    extra_link_args=[*LINK_ARGS, f"-Wl,--version-script={EXTENSION_MAP}"],
    depends=[EXTENSION_MAP],
)

# The pybind11 half of native/: everything else is the data path the C API links too.
PYTHON_BINDINGS = {"native/bindings.cpp", "native/engine/bindings.cpp", "native/common/bindings_errors.cpp"}
CAPI_DIR = "plugins/trtllm/capi"
CAPI_LIB = "libtransfer_engine.so"


class build_ext_and_capi(build_ext):
    """Builds tidekv._native, then libtransfer_engine.so from the same objects of native/ plus
    plugins/trtllm/capi, into tidekv_trtllm/lib (and into plugins/trtllm/lib for in-place and
    editable builds, where the source tree is the package)."""

    def run(self):
        if self.built_in_place_is_current():
            print("tidekv._native and libtransfer_engine.so in the source tree are newer than every file they are "
                  "built from: not rebuilt (delete core/_native*.so to force a build)")
            return
        super().run()
        self.build_capi()

    def built_in_place_is_current(self):
        """Editable and in-place builds: whether both libraries in the source tree are newer than
        every file under native/ and plugins/trtllm/capi and the build files (make's rule). Their
        names carry this interpreter's ABI (EXT_SUFFIX), so another Python builds its own. This is
        what lets a second venv of the same checkout (integration/setup_*.sh) skip the compile."""
        if not (self.inplace or getattr(self, "editable_mode", False)) or self.force:
            return False
        package_dir = self.get_finalized_command("build_py").get_package_dir("tidekv")
        outputs = [os.path.join(package_dir, os.path.basename(self.get_ext_filename(native.name))),
                   os.path.join("plugins/trtllm/lib", CAPI_LIB)]
        inputs = [f for f in glob("native/**", recursive=True) + glob(f"{CAPI_DIR}/*") + ["setup.py", "pyproject.toml"]
                  if os.path.isfile(f)]
        if not all(os.path.exists(f) for f in outputs):
            return False
        return min(os.path.getmtime(f) for f in outputs) > max(os.path.getmtime(f) for f in inputs)

    def build_capi(self):
        data_path = [s for s in native.sources if s not in PYTHON_BINDINGS]
        # Compiled already for the extension (same flags, same build_temp): reused, not rebuilt.
        objects = self.compiler.object_filenames(data_path, output_dir=self.build_temp)
        missing = [src for src, obj in zip(data_path, objects) if not os.path.exists(obj)]
        if missing:  # the extension was up to date, its objects gone: build just those
            self.compiler.compile(missing, output_dir=self.build_temp, include_dirs=["native"],
                                  extra_postargs=["-std=c++17", *COMPILE_ARGS])
        capi_sources = sorted(glob(f"{CAPI_DIR}/*.cpp"))
        objects += self.compiler.compile(
            capi_sources, output_dir=os.path.join(self.build_temp, "capi"), include_dirs=["native", CAPI_DIR],
            extra_postargs=["-std=c++17", *COMPILE_ARGS], depends=glob(f"{CAPI_DIR}/*.h"))
        out_dir = os.path.join(self.build_lib, "tidekv_trtllm", "lib")
        self.compiler.link_shared_object(
            objects, CAPI_LIB, output_dir=out_dir, target_lang="c++",
            extra_postargs=[*LINK_ARGS, f"-Wl,-soname,{CAPI_LIB}", f"-Wl,--version-script={CAPI_DIR}/exports.map",
                            "-Wl,--no-undefined"])
        if self.inplace or getattr(self, "editable_mode", False):
            os.makedirs("plugins/trtllm/lib", exist_ok=True)
            # By rename, so a process that has the old library loaded keeps its copy intact.
            tmp = os.path.join("plugins/trtllm/lib", f".{CAPI_LIB}.new")
            shutil.copyfile(os.path.join(out_dir, CAPI_LIB), tmp)
            os.replace(tmp, os.path.join("plugins/trtllm/lib", CAPI_LIB))


setup(ext_modules=[native], cmdclass={"build_ext": build_ext_and_capi})
