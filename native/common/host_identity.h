// What tells two processes they are on one host: the kernel's boot id.
#pragma once

#include <fstream>
#include <string>

namespace tidekv {

inline std::string local_boot_id() {
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(f, id);
  return id;
}

}  // namespace tidekv
