// libspecrt_ops: specrt's ONNX Runtime custom operators, in the domain "specrt", registered by
// SessionOptions.register_custom_ops_library (Python) or RegisterCustomOps (C/C++).
//
//   specrt::MatMulGGUF(A: float [..., K], W: uint8 [N, K/32 * block bytes]) -> Y: float [..., N]
//     attributes: format ("Q4_0" | "Q4_1" | "Q8_0"), K, N.  W is the GGUF tensor's bytes as the file has them;
//     Y = A Wᵀ with A's rows quantized per 32-block to int8 (gguf_kernels.h).
#include "gguf_kernels.h"

#define ORT_API_MANUAL_INIT
#include <onnxruntime/onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <mutex>
#include <stdexcept>

namespace {

using specrt::ops::Format;

struct MatMulGGUFKernel {
    MatMulGGUFKernel(const OrtApi&, const OrtKernelInfo* info) {
        Ort::ConstKernelInfo ki(info);
        const std::string format = ki.GetAttribute<std::string>("format");
        if (!specrt::ops::parse_format(format, &format_))
            throw Ort::Exception("specrt::MatMulGGUF: format " + format + " (Q4_0, Q4_1 or Q8_0)", ORT_INVALID_ARGUMENT);
        k_ = ki.GetAttribute<int64_t>("K");
        n_ = ki.GetAttribute<int64_t>("N");
        if (k_ <= 0 || n_ <= 0 || k_ % specrt::ops::kBlock)
            throw Ort::Exception("specrt::MatMulGGUF: K must be a positive multiple of 32 and N positive", ORT_INVALID_ARGUMENT);
        isa_ = specrt::ops::best_isa();
    }

    void Compute(OrtKernelContext* context) {
        Ort::KernelContext ctx(context);
        Ort::ConstValue a = ctx.GetInput(0), w = ctx.GetInput(1);
        std::vector<int64_t> shape = a.GetTensorTypeAndShapeInfo().GetShape();
        std::vector<int64_t> wshape = w.GetTensorTypeAndShapeInfo().GetShape();
        const int64_t row_bytes = k_ / specrt::ops::kBlock * specrt::ops::block_bytes(format_);
        if (shape.empty() || shape.back() != k_)
            throw Ort::Exception("specrt::MatMulGGUF: A's last axis is not K", ORT_INVALID_ARGUMENT);
        if (wshape.size() != 2 || wshape[0] != n_ || wshape[1] != row_bytes)
            throw Ort::Exception("specrt::MatMulGGUF: W is not [N, K/32 * block bytes]", ORT_INVALID_ARGUMENT);
        int64_t m = 1;
        for (size_t i = 0; i + 1 < shape.size(); ++i) m *= shape[i];
        shape.back() = n_;
        Ort::UnownedValue y = ctx.GetOutput(0, shape);
        if (m == 0) return;
        // per calling thread: sessions may run the same kernel from several threads at once
        thread_local specrt::ops::Activations acts;
        specrt::ops::quantize(a.GetTensorData<float>(), m, k_, acts);
        Job job{this, &acts, w.GetTensorData<uint8_t>(), y.GetTensorMutableData<float>()};
        const int64_t tiles = (n_ + kTile - 1) / kTile;
        ctx.ParallelFor(&MatMulGGUFKernel::tile, static_cast<size_t>(tiles), 0, &job);
    }

private:
    static constexpr int64_t kTile = 16;  // weight rows per task
    struct Job {
        MatMulGGUFKernel* self;
        const specrt::ops::Activations* acts;
        const uint8_t* w;
        float* y;
    };
    static void tile(void* data, size_t t) {
        const Job& j = *static_cast<Job*>(data);
        const int64_t n0 = static_cast<int64_t>(t) * kTile, n1 = std::min(n0 + kTile, j.self->n_);
        specrt::ops::matmul_rows(j.self->isa_, j.self->format_, j.w, *j.acts, n0, n1, j.self->n_, j.y);
    }

    Format format_ = Format::Q4_0;
    int64_t k_ = 0, n_ = 0;
    specrt::ops::Isa isa_ = specrt::ops::Isa::Scalar;
};

struct MatMulGGUFOp : Ort::CustomOpBase<MatMulGGUFOp, MatMulGGUFKernel> {
    void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new MatMulGGUFKernel(api, info); }
    const char* GetName() const { return "MatMulGGUF"; }
    const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
    size_t GetInputTypeCount() const { return 2; }
    ONNXTensorElementDataType GetInputType(size_t i) const {
        return i == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8;
    }
    size_t GetOutputTypeCount() const { return 1; }
    ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

}  // namespace

extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options,
                                                                                          const OrtApiBase* api_base) {
    const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
    if (!api) return nullptr;  // cannot even report: an ONNX Runtime older than these headers
    Ort::InitApi(api);
    static MatMulGGUFOp matmul;
    static std::once_flag once;
    static Ort::CustomOpDomain* domain = nullptr;
    try {
        std::call_once(once, [] {
            domain = new Ort::CustomOpDomain("specrt");  // lives as long as the process: sessions keep using it
            domain->Add(&matmul);
        });
        Ort::UnownedSessionOptions(options).Add(*domain);
    } catch (const std::exception& e) {
        return api->CreateStatus(ORT_FAIL, e.what());
    }
    return nullptr;
}

// Which instruction set the kernels use here (for tests and benchmarks): "avx512vnni", "avx2" or "scalar".
extern "C" __attribute__((visibility("default"))) const char* specrt_ops_isa() {
    return specrt::ops::isa_name(specrt::ops::best_isa());
}
