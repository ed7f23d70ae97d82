// ONNX Runtime's library, found when the first engine opens rather than by the dynamic linker: libspecrt is built
// with ORT_API_MANUAL_INIT and has no link-time dependency on libonnxruntime, so one build runs beside whichever
// onnxruntime wheel (API version >= the headers') a Python environment has, installed or editable, and a C program
// needs no LD_LIBRARY_PATH. Where it looks, in order:
//   $SPECRT_ONNXRUNTIME_LIB                      (set by the `specrt-cpp` launcher and specrt's Python callers)
//   libonnxruntime.so.1 beside libspecrt         (the CMake build folder links the wheel's library there)
//   ../../onnxruntime/capi/libonnxruntime.so.1.*  (libspecrt installed in site-packages/specrt/_native, beside the
//                                                 onnxruntime wheel)
//   libonnxruntime.so.1 on the system's search path (LD_LIBRARY_PATH, a distribution's libonnxruntime1.xx)
#include "runner.h"

#include <dlfcn.h>

#include <mutex>

namespace specrt {

namespace {

using GetApiBase = const OrtApiBase* (*)();

std::vector<std::string> candidates() {
    std::vector<std::string> found;
    if (const char* given = std::getenv("SPECRT_ONNXRUNTIME_LIB"); given && *given) found.emplace_back(given);
    Dl_info info;
    if (dladdr(reinterpret_cast<void*>(&candidates), &info) && info.dli_fname) {
        const fs::path here = fs::absolute(fs::path(info.dli_fname)).parent_path();
        if (fs::exists(here / "libonnxruntime.so.1")) found.push_back((here / "libonnxruntime.so.1").string());
        std::error_code ec;
        const fs::path wheel = here.parent_path().parent_path() / "onnxruntime" / "capi";
        for (const auto& entry : fs::directory_iterator(wheel, ec)) {
            const std::string name = entry.path().filename().string();
            if (name.rfind("libonnxruntime.so.1", 0) == 0) found.push_back(entry.path().string());
        }
    }
    found.emplace_back("libonnxruntime.so.1");
    return found;
}

std::string load() {  // "" when loaded, else why not
    std::string tried;
    for (const std::string& path : candidates()) {
        void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
        if (!lib) {
            tried += (tried.empty() ? "" : ", ") + path;
            continue;
        }
        auto base = reinterpret_cast<GetApiBase>(dlsym(lib, "OrtGetApiBase"));
        const OrtApi* api = base ? base()->GetApi(ORT_API_VERSION) : nullptr;
        if (!api) {
            return path + " is not an ONNX Runtime library of API version " + std::to_string(ORT_API_VERSION) +
                   " or newer (" + (base ? std::string("version ") + base()->GetVersionString() : "no OrtGetApiBase") +
                   ")";
        }
        Ort::InitApi(api);  // the library stays loaded for the process: sessions and the environment live in it
        return "";
    }
    return "ONNX Runtime's library was not found (tried " + tried +
           "): pip install onnxruntime beside specrt, or set $SPECRT_ONNXRUNTIME_LIB to libonnxruntime.so.1";
}

}  // namespace

void load_onnxruntime() {
    static std::once_flag once;
    static std::string error;
    std::call_once(once, [] { error = load(); });
    if (!error.empty()) throw Error(SPECRT_ERROR_RUNTIME, error);
}

}  // namespace specrt
