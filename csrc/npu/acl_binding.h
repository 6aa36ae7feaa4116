// How the NPU backend binds ACL (AscendCL, libascendcl.so) entry points.
//
// Linked directly: only entry points that libtorch_npu.so itself imports directly
// (`nm -D --undefined-only libtorch_npu.so`), so that every CANN torch_npu loads on has
// them. The backend uses four: aclrtMemcpyAsync, aclrtCreateEventExWithFlag,
// aclrtRecordEvent, aclrtDestroyEvent.
//
// Resolved at run time: every other entry point, looked up by name in the already loaded
// libascendcl.so, as torch_npu does for its own optional ones (AclInterface.cpp:
// dlopen("libascendcl.so") + dlsym; those helpers are hidden in libtorch_npu.so, so they
// cannot be called from here). Each call site has a fallback for a CANN that lacks one.
//
// scripts/check_npu_build.sh fails when the built extension imports an ACL symbol that
// libtorch_npu.so does not; tests/test_npu_build.py names both lists.
#pragma once

#include <acl/acl.h>
#include <dlfcn.h>

namespace kvops {

// libascendcl.so is already loaded (this extension and libtorch_npu.so link it). A handle
// from dlopen is needed rather than RTLD_DEFAULT: Python loads extension modules, and with
// them their dependencies, with RTLD_LOCAL. Null only if the library cannot be opened.
inline void* acl_library() {
  static void* const lib = [] {
    void* handle = dlopen("libascendcl.so", RTLD_LAZY | RTLD_NOLOAD);
    return handle != nullptr ? handle : dlopen("libascendcl.so", RTLD_LAZY);
  }();
  return lib;
}

// The ACL function `name` typed `Fn`, or nullptr when this CANN does not export it.
template <typename Fn>
Fn acl_optional(const char* name) {
  void* lib = acl_library();
  return lib == nullptr ? nullptr : reinterpret_cast<Fn>(dlsym(lib, name));
}

}  // namespace kvops

// acl_optional for `name`, typed exactly as the ACL header declares it. decltype does not
// odr-use `name`, so the extension does not import the symbol.
#define KVOPS_ACL_OPTIONAL(name) (::kvops::acl_optional<decltype(&::name)>(#name))
