// libspecrt_ops: specrt's ONNX Runtime custom operators, in the domain "specrt", registered by
// SessionOptions.register_custom_ops_library (Python) or RegisterCustomOps (C/C++).
//
//   specrt::MatMulGGUF(A: float [..., K], W: uint8 [N, K / block elements * block bytes]) -> Y: float [..., N]
//     attributes: format (a name in kFormats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), K (a multiple of the
//     format's block: 32, or 256 for the K-quants), N, activation ("" or "swiglu", optional).  W is the GGUF
//     tensor's bytes as the file has them; Y = A Wᵀ with A's rows quantized per 32-block to int8 (gguf_kernels.h).
//     With activation "swiglu" (W: gate's rows then up's) Y is [..., N/2]: silu(gate) * up, one node for an MLP's
//     Split, SiLU and Mul.
//   specrt::GatherGGUF(W: uint8 [V, K / block elements * block bytes], ids: int64 [...]) -> Y: float [..., K]
//     attributes: format, K.  Rows of a GGUF table (the embedding), dequantized.
//   specrt::RMSNorm(X: float [..., d], W: float [d]) -> Y: float [..., d]; attribute epsilon.
//     Y = X / sqrt(mean(X^2) + epsilon) * W per row.
//   specrt::SkipRMSNorm(X, skip: float [..., d], W: float [d]) -> (Y, S: float [..., d]); attribute epsilon.
//     S = X + skip, Y = RMSNorm(S): a residual add and the norm after it.
//   specrt::CacheAttention(q: float [B, T, H, D], k, v: float, float16 or bfloat16 [B, Hkv, S, D] (one type),
//                          bias: float [B, 1, 1, T or 1, L])
//     -> Y: float [B, T, H, D]; attribute scale.  softmax(q·scale·kᵀ + bias)·v over the first L keys, the cache's
//     elements widened to float32 (attention.h).
//   specrt::PackedAttention(qkv: float [P, (H + 2 Hkv) D], cos, sin: float [B, T, 1, D], slots: int64 [B, T],
//                           bias: float [B, 1, 1, T or 1, L], cells: int64 [P], past_k, past_v: [B, Hkv, S, D],
//                           optional q_norm, k_norm: float [D])
//     -> Y: float [P, H D], present_k, present_v: [B, Hkv, S, D] (past's type); attributes scale, heads, kv_heads,
//     epsilon (with the norms: each q and k head RMS-normed before its rope, as Qwen3's layers do).
//     A packed call's attention in one node: the P tokens' q and k rotated (rope), their k and v written into the
//     cache at slots[cell], then CacheAttention's rows for the cells, packed. present is past with the writes: bound
//     to past's buffer it is written in place, otherwise past is copied first.
// Every operator computes each output row alone, in one fixed order: a row's bits never depend on the call's rows.
#include "attention.h"
#include "gguf_kernels.h"

#define ORT_API_MANUAL_INIT
#include <onnxruntime/onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <cstring>
#include <mutex>
#include <stdexcept>

namespace {

using specrt::ops::Format;

struct MatMulGGUFKernel {
    MatMulGGUFKernel(const OrtApi&, const OrtKernelInfo* info) {
        Ort::ConstKernelInfo ki(info);
        const std::string format = ki.GetAttribute<std::string>("format");
        if (!specrt::ops::parse_format(format, &format_))
            throw Ort::Exception("specrt::MatMulGGUF: format " + format + " (" + specrt::ops::format_names() + ")",
                                 ORT_INVALID_ARGUMENT);
        k_ = ki.GetAttribute<int64_t>("K");
        n_ = ki.GetAttribute<int64_t>("N");
        const int64_t elems = specrt::ops::traits(format_).block_elems;
        if (k_ <= 0 || n_ <= 0 || k_ % elems)
            throw Ort::Exception("specrt::MatMulGGUF: K must be a positive multiple of " + std::to_string(elems) +
                                 " (" + format + "'s block) and N positive", ORT_INVALID_ARGUMENT);
        std::string activation;
        try {
            activation = ki.GetAttribute<std::string>("activation");
        } catch (const Ort::Exception&) {  // absent: none
        }
        if (activation == "swiglu") {
            swiglu_ = true;
        } else if (!activation.empty()) {
            throw Ort::Exception("specrt::MatMulGGUF: activation " + activation + " (\"\" or swiglu)",
                                 ORT_INVALID_ARGUMENT);
        }
        if (swiglu_ && n_ % 2)
            throw Ort::Exception("specrt::MatMulGGUF: swiglu needs an even N (gate's rows, then up's)",
                                 ORT_INVALID_ARGUMENT);
        isa_ = specrt::ops::best_isa();
        prefetch_from_ = specrt::ops::prefetch_rows();
        wide_ = specrt::ops::wide_vectors();
        // weights that are an initializer are repacked once, 8 rows at a time (gguf_kernels.h, Packed)
        int constant = 0;
        Ort::ConstValue w = ki.GetTensorConstantInput(1, &constant);
        if (constant && isa_ != specrt::ops::Isa::Scalar) {
            const std::vector<int64_t> ws = w.GetTensorTypeAndShapeInfo().GetShape();
            const int64_t blocks = k_ / specrt::ops::kBlock;
            if (ws.size() == 2 && ws[0] == n_ && ws[1] == specrt::ops::row_bytes(format_, k_)) {
                specrt::ops::pack(format_, w.GetTensorData<uint8_t>(), n_, blocks, packed_);
                // the packed copy is what the calls read: the file's pages that held W leave the process's memory
                specrt::ops::release_file_pages(w.GetTensorData<uint8_t>(), static_cast<size_t>(n_ * ws[1]));
            }
        }
    }

    void Compute(OrtKernelContext* context) {
        Ort::KernelContext ctx(context);
        Ort::ConstValue a = ctx.GetInput(0), w = ctx.GetInput(1);
        std::vector<int64_t> shape = a.GetTensorTypeAndShapeInfo().GetShape();
        std::vector<int64_t> wshape = w.GetTensorTypeAndShapeInfo().GetShape();
        const int64_t row_bytes = specrt::ops::row_bytes(format_, k_);
        if (shape.empty() || shape.back() != k_)
            throw Ort::Exception("specrt::MatMulGGUF: A's last axis is not K", ORT_INVALID_ARGUMENT);
        if (wshape.size() != 2 || wshape[0] != n_ || wshape[1] != row_bytes)
            throw Ort::Exception("specrt::MatMulGGUF: W is not [N, K / block elements * block bytes]", ORT_INVALID_ARGUMENT);
        int64_t m = 1;
        for (size_t i = 0; i + 1 < shape.size(); ++i) m *= shape[i];
        shape.back() = swiglu_ ? n_ / 2 : n_;
        Ort::UnownedValue y = ctx.GetOutput(0, shape);
        if (m == 0) return;
        // per calling thread: sessions may run the same kernel from several threads at once
        thread_local specrt::ops::Activations acts;
        thread_local std::vector<float> product;  // A Wᵀ before the activation
        specrt::ops::quantize(isa_, a.GetTensorData<float>(), m, k_, acts);
        float* out = y.GetTensorMutableData<float>();
        if (swiglu_) product.resize(m * n_);
        Job job{this, &acts, w.GetTensorData<uint8_t>(), swiglu_ ? product.data() : out, out};
        const int64_t half_groups = n_ / 2 % specrt::ops::kGroup ? 0 : n_ / 2 / specrt::ops::kGroup;
        if (!packed_.data.empty() && swiglu_ && half_groups) {  // each task: gate's and up's groups, then SwiGLU
            const int64_t tasks = (half_groups + kGroupsPerTask - 1) / kGroupsPerTask;
            ctx.ParallelFor(&MatMulGGUFKernel::swiglu_groups, static_cast<size_t>(tasks), 0, &job);
            return;
        }
        if (!packed_.data.empty()) {
            const int64_t tasks = (packed_.groups + kGroupsPerTask - 1) / kGroupsPerTask;
            ctx.ParallelFor(&MatMulGGUFKernel::groups, static_cast<size_t>(tasks), 0, &job);
        } else {
            const int64_t tiles = (n_ + kTile - 1) / kTile;
            ctx.ParallelFor(&MatMulGGUFKernel::tile, static_cast<size_t>(tiles), 0, &job);
        }
        if (swiglu_) specrt::ops::swiglu(isa_, product.data(), m, n_ / 2, 0, n_ / 2, out);
    }

private:
    static constexpr int64_t kTile = 16;  // weight rows per task
    static constexpr int64_t kGroupsPerTask = 2;  // packed: groups of 8 weight rows per task
    struct Job {
        MatMulGGUFKernel* self;
        const specrt::ops::Activations* acts;
        const uint8_t* w;
        float* y;    // the product A Wᵀ [M, N]
        float* out;  // the output (swiglu: [M, N/2])
    };
    static void tile(void* data, size_t t) {
        const Job& j = *static_cast<Job*>(data);
        const int64_t n0 = static_cast<int64_t>(t) * kTile, n1 = std::min(n0 + kTile, j.self->n_);
        specrt::ops::matmul_rows(j.self->isa_, j.self->format_, j.w, *j.acts, n0, n1, j.self->n_, j.y);
    }

    static void groups(void* data, size_t t) {
        const Job& j = *static_cast<Job*>(data);
        const specrt::ops::Packed& p = j.self->packed_;
        const int64_t g0 = static_cast<int64_t>(t) * kGroupsPerTask, g1 = std::min(g0 + kGroupsPerTask, p.groups);
        specrt::ops::matmul_packed(j.self->isa_, p, *j.acts, g0, g1, j.self->n_, j.y, j.self->prefetch_from_,
                                   j.self->wide_);
    }

    // swiglu over packed weights whose N/2 is a whole number of groups: gate's groups [g0, g1), up's the same groups
    // N/2 rows on, then SwiGLU on those columns while they are in this core's cache
    static void swiglu_groups(void* data, size_t t) {
        const Job& j = *static_cast<Job*>(data);
        const specrt::ops::Packed& p = j.self->packed_;
        const int64_t n = j.self->n_, half = n / 2, half_groups = half / specrt::ops::kGroup;
        const int64_t g0 = static_cast<int64_t>(t) * kGroupsPerTask, g1 = std::min(g0 + kGroupsPerTask, half_groups);
        specrt::ops::matmul_packed(j.self->isa_, p, *j.acts, g0, g1, n, j.y, j.self->prefetch_from_, j.self->wide_);
        specrt::ops::matmul_packed(j.self->isa_, p, *j.acts, g0 + half_groups, g1 + half_groups, n, j.y,
                                   j.self->prefetch_from_, j.self->wide_);
        specrt::ops::swiglu(j.self->isa_, j.y, j.acts->m, half, g0 * specrt::ops::kGroup, g1 * specrt::ops::kGroup,
                            j.out);
    }

    Format format_ = Format::Q4_0;
    int64_t k_ = 0, n_ = 0;
    bool swiglu_ = false;
    specrt::ops::Isa isa_ = specrt::ops::Isa::Scalar;
    int prefetch_from_ = 4;
    bool wide_ = false;
    specrt::ops::Packed packed_;  // empty: W is not an initializer, or the scalar reference runs
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

struct GatherGGUFKernel {
    GatherGGUFKernel(const OrtApi&, const OrtKernelInfo* info) {
        Ort::ConstKernelInfo ki(info);
        const std::string format = ki.GetAttribute<std::string>("format");
        if (!specrt::ops::parse_format(format, &format_))
            throw Ort::Exception("specrt::GatherGGUF: format " + format + " (" + specrt::ops::format_names() + ")",
                                 ORT_INVALID_ARGUMENT);
        k_ = ki.GetAttribute<int64_t>("K");
        const int64_t elems = specrt::ops::traits(format_).block_elems;
        if (k_ <= 0 || k_ % elems)
            throw Ort::Exception("specrt::GatherGGUF: K must be a positive multiple of " + std::to_string(elems) +
                                 " (" + format + "'s block)", ORT_INVALID_ARGUMENT);
    }

    void Compute(OrtKernelContext* context) {
        Ort::KernelContext ctx(context);
        Ort::ConstValue w = ctx.GetInput(0), ids = ctx.GetInput(1);
        const std::vector<int64_t> wshape = w.GetTensorTypeAndShapeInfo().GetShape();
        std::vector<int64_t> shape = ids.GetTensorTypeAndShapeInfo().GetShape();
        const int64_t row_bytes = specrt::ops::row_bytes(format_, k_);
        if (wshape.size() != 2 || wshape[1] != row_bytes)
            throw Ort::Exception("specrt::GatherGGUF: W is not [V, K / block elements * block bytes]",
                                 ORT_INVALID_ARGUMENT);
        const size_t n = ids.GetTensorTypeAndShapeInfo().GetElementCount();
        shape.push_back(k_);
        Ort::UnownedValue y = ctx.GetOutput(0, shape);
        const int64_t* id = ids.GetTensorData<int64_t>();
        const uint8_t* table = w.GetTensorData<uint8_t>();
        float* out = y.GetTensorMutableData<float>();
        for (size_t i = 0; i < n; ++i) {
            const int64_t row = id[i] < 0 ? id[i] + wshape[0] : id[i];  // Gather's negative indices
            if (row < 0 || row >= wshape[0])
                throw Ort::Exception("specrt::GatherGGUF: index " + std::to_string(id[i]) + " is out of range",
                                     ORT_INVALID_ARGUMENT);
            specrt::ops::dequantize_row(format_, table + row * row_bytes, k_, out + i * k_);
        }
    }

private:
    Format format_ = Format::Q4_0;
    int64_t k_ = 0;
};

struct GatherGGUFOp : Ort::CustomOpBase<GatherGGUFOp, GatherGGUFKernel> {
    void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new GatherGGUFKernel(api, info); }
    const char* GetName() const { return "GatherGGUF"; }
    const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
    size_t GetInputTypeCount() const { return 2; }
    ONNXTensorElementDataType GetInputType(size_t i) const {
        return i == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
    }
    size_t GetOutputTypeCount() const { return 1; }
    ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

// specrt::RMSNorm (Skip = false) and specrt::SkipRMSNorm (Skip = true: the sum of X and skip first, an output too).
// On the calling thread: a call's rows are few (tokens of a decode or verify), ONNX Runtime's own norm kernels spend
// more waking a second thread for them than the norm takes.
template <bool Skip>
struct RMSNormKernel {
    RMSNormKernel(const OrtApi&, const OrtKernelInfo* info) {
        epsilon_ = Ort::ConstKernelInfo(info).GetAttribute<float>("epsilon");
        isa_ = specrt::ops::best_isa();
    }

    void Compute(OrtKernelContext* context) {
        Ort::KernelContext ctx(context);
        const char* name = Skip ? "specrt::SkipRMSNorm: " : "specrt::RMSNorm: ";
        auto fail = [name](const char* what) { throw Ort::Exception(std::string(name) + what, ORT_INVALID_ARGUMENT); };
        Ort::ConstValue x = ctx.GetInput(0), w = ctx.GetInput(Skip ? 2 : 1);
        const std::vector<int64_t> shape = x.GetTensorTypeAndShapeInfo().GetShape();
        if (shape.empty() || w.GetTensorTypeAndShapeInfo().GetShape() != std::vector<int64_t>{shape.back()})
            fail("W must be [d], X's last axis");
        const int64_t d = shape.back();
        const int64_t m = d ? static_cast<int64_t>(x.GetTensorTypeAndShapeInfo().GetElementCount()) / d : 0;
        float* y = ctx.GetOutput(0, shape).GetTensorMutableData<float>();
        const float* in = x.GetTensorData<float>();
        if constexpr (Skip) {
            Ort::ConstValue skip = ctx.GetInput(1);
            if (skip.GetTensorTypeAndShapeInfo().GetShape() != shape) fail("skip must have X's shape");
            float* sum = ctx.GetOutput(1, shape).GetTensorMutableData<float>();
            const float* add = skip.GetTensorData<float>();
            for (int64_t i = 0; i < m * d; ++i) sum[i] = in[i] + add[i];
            in = sum;
        }
        if (m > 0 && d > 0) specrt::ops::rms_norm(isa_, in, w.GetTensorData<float>(), m, d, epsilon_, y);
    }

private:
    float epsilon_ = 0.0f;
    specrt::ops::Isa isa_ = specrt::ops::Isa::Scalar;
};

template <bool Skip>
struct RMSNormOp : Ort::CustomOpBase<RMSNormOp<Skip>, RMSNormKernel<Skip>> {
    void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const {
        return new RMSNormKernel<Skip>(api, info);
    }
    const char* GetName() const { return Skip ? "SkipRMSNorm" : "RMSNorm"; }
    const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
    size_t GetInputTypeCount() const { return Skip ? 3 : 2; }
    ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
    size_t GetOutputTypeCount() const { return Skip ? 2 : 1; }
    ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

// The cache's element type as a CacheType; false for any other type.
bool cache_type_of(ONNXTensorElementDataType t, specrt::ops::CacheType* out) {
    switch (t) {
        case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT: *out = specrt::ops::CacheType::F32; return true;
        case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: *out = specrt::ops::CacheType::F16; return true;
        case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16: *out = specrt::ops::CacheType::BF16; return true;
        default: return false;
    }
}

// The attention rows of `tasks` (attention_plan), spread over ONNX Runtime's threads: q and out are [B, T, H, D].
void attend_rows(Ort::KernelContext& ctx, specrt::ops::Isa isa, const specrt::ops::AttentionShape& s,
                 const std::vector<specrt::ops::AttentionTask>& tasks, const float* q, const float* bias,
                 const void* k, const void* v, float* out) {
    struct Job {
        specrt::ops::Isa isa;
        const specrt::ops::AttentionShape* s;
        const std::vector<specrt::ops::AttentionTask>* tasks;
        const float *q, *bias;
        const void *k, *v;
        float* y;
    } job{isa, &s, &tasks, q, bias, k, v, out};
    auto task = [](void* data, size_t t) {
        const Job& j = *static_cast<Job*>(data);
        thread_local std::vector<float> scratch;
        scratch.resize(specrt::ops::attention_scratch(*j.s));
        const uintptr_t at = reinterpret_cast<uintptr_t>(scratch.data());
        float* aligned = scratch.data() + ((32 - at % 32) % 32) / sizeof(float);  // 32 bytes: vector loads
        specrt::ops::attention_run(j.isa, *j.s, j.q, j.k, j.v, j.bias, (*j.tasks)[t], aligned, j.y);
    };
    ctx.ParallelFor(task, tasks.size(), 0, &job);
}

struct CacheAttentionKernel {
    CacheAttentionKernel(const OrtApi&, const OrtKernelInfo* info) {
        scale_ = Ort::ConstKernelInfo(info).GetAttribute<float>("scale");
        isa_ = specrt::ops::best_isa();
    }

    void Compute(OrtKernelContext* context) {
        Ort::KernelContext ctx(context);
        Ort::ConstValue q = ctx.GetInput(0), k = ctx.GetInput(1), v = ctx.GetInput(2), bias = ctx.GetInput(3);
        const std::vector<int64_t> qs = q.GetTensorTypeAndShapeInfo().GetShape(),
                                   ks = k.GetTensorTypeAndShapeInfo().GetShape(),
                                   vs = v.GetTensorTypeAndShapeInfo().GetShape(),
                                   bs = bias.GetTensorTypeAndShapeInfo().GetShape();
        auto fail = [](const char* what) {
            throw Ort::Exception(std::string("specrt::CacheAttention: ") + what, ORT_INVALID_ARGUMENT);
        };
        if (qs.size() != 4 || ks.size() != 4 || vs != ks || bs.size() != 5) fail("expects q [B,T,H,D], k and v "
                                                                                "[B,Hkv,S,D], bias [B,1,1,T|1,L]");
        specrt::ops::AttentionShape s{qs[0], qs[1], qs[2], ks[1], qs[3], ks[2], bs[4], bs[3], scale_};
        const ONNXTensorElementDataType kt = k.GetTensorTypeAndShapeInfo().GetElementType();
        if (kt != v.GetTensorTypeAndShapeInfo().GetElementType()) fail("k and v must have one element type");
        if (!cache_type_of(kt, &s.cache_type)) fail("k and v must be float, float16 or bfloat16");
        if (ks[0] != s.batch || ks[3] != s.head_dim || s.kv_heads <= 0 || s.heads % s.kv_heads)
            fail("k and v must be [B, Hkv, S, D] with Hkv dividing H");
        if (s.head_dim % 8 || s.head_dim > specrt::ops::kMaxHeadDim) fail("head size must be a multiple of 8, <= 256");
        if (bs[0] != s.batch || bs[1] != 1 || bs[2] != 1 || (s.bias_tokens != 1 && s.bias_tokens != s.tokens) ||
            s.keys > s.cache)
            fail("bias must be [B, 1, 1, T or 1, L] with L <= the cache length");
        Ort::UnownedValue y = ctx.GetOutput(0, qs);
        if (s.batch * s.tokens * s.heads == 0) return;
        if (s.keys == 0) fail("no keys to attend");
        if (s.heads / s.kv_heads * specrt::ops::kTokensPerTask > 64) fail("more than 32 query heads per KV head");
        float* out = y.GetTensorMutableData<float>();
        // optional `cells` [P]: the grid cells b * T + t a packed verify computes; the others are written as zeros
        std::vector<uint8_t> computed;
        if (ctx.GetInputCount() > 4) {
            Ort::ConstValue cells = ctx.GetInput(4);
            if (cells) {
                const int64_t grid = s.batch * s.tokens, row = s.heads * s.head_dim;
                const int64_t p = cells.GetTensorTypeAndShapeInfo().GetElementCount();
                const int64_t* at = cells.GetTensorData<int64_t>();
                computed.assign(grid, 0);
                for (int64_t i = 0; i < p; ++i) {
                    if (at[i] < 0 || at[i] >= grid) fail("cells must index the [B, T] grid of q");
                    computed[at[i]] = 1;
                }
                for (int64_t c = 0; c < grid; ++c)
                    if (!computed[c]) std::memset(out + c * row, 0, sizeof(float) * row);
            }
        }
        const std::vector<specrt::ops::AttentionTask> tasks =
            specrt::ops::attention_plan(s, bias.GetTensorData<float>(), computed.empty() ? nullptr : computed.data());
        attend_rows(ctx, isa_, s, tasks, q.GetTensorData<float>(), bias.GetTensorData<float>(), k.GetTensorRawData(),
                    v.GetTensorRawData(), out);
    }

private:
    float scale_ = 1.0f;
    specrt::ops::Isa isa_ = specrt::ops::Isa::Scalar;
};

struct CacheAttentionOp : Ort::CustomOpBase<CacheAttentionOp, CacheAttentionKernel> {
    void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const {
        return new CacheAttentionKernel(api, info);
    }
    const char* GetName() const { return "CacheAttention"; }
    const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
    size_t GetInputTypeCount() const { return 5; }
    ONNXTensorElementDataType GetInputType(size_t i) const {  // k and v: any type here, checked in Compute
        if (i == 4) return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;  // cells
        return i == 1 || i == 2 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
    }
    OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
        return i == 4 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
    }
    size_t GetOutputTypeCount() const { return 1; }
    ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

struct PackedAttentionKernel {
    PackedAttentionKernel(const OrtApi&, const OrtKernelInfo* info) {
        Ort::ConstKernelInfo ki(info);
        scale_ = ki.GetAttribute<float>("scale");
        heads_ = ki.GetAttribute<int64_t>("heads");
        kv_heads_ = ki.GetAttribute<int64_t>("kv_heads");
        if (heads_ <= 0 || kv_heads_ <= 0 || heads_ % kv_heads_)
            throw Ort::Exception("specrt::PackedAttention: heads must be a positive multiple of kv_heads",
                                 ORT_INVALID_ARGUMENT);
        try {
            epsilon_ = ki.GetAttribute<float>("epsilon");
        } catch (const Ort::Exception&) {  // absent: no q/k norms read it
        }
        isa_ = specrt::ops::best_isa();
    }

    void Compute(OrtKernelContext* context) {
        Ort::KernelContext ctx(context);
        auto fail = [](const std::string& what) {
            throw Ort::Exception("specrt::PackedAttention: " + what, ORT_INVALID_ARGUMENT);
        };
        Ort::ConstValue qkv = ctx.GetInput(0), cos = ctx.GetInput(1), sin = ctx.GetInput(2), slots = ctx.GetInput(3),
                        bias = ctx.GetInput(4), cells = ctx.GetInput(5), pk = ctx.GetInput(6), pv = ctx.GetInput(7);
        auto shape = [](const Ort::ConstValue& x) { return x.GetTensorTypeAndShapeInfo().GetShape(); };
        const std::vector<int64_t> xs = shape(qkv), ss = shape(slots), bs = shape(bias), ks = shape(pk);
        if (xs.size() != 2 || xs[1] % (heads_ + 2 * kv_heads_)) fail("qkv must be [P, (H + 2 Hkv) D]");
        if (ss.size() != 2) fail("slots must be [B, T]");
        if (ks.size() != 4 || shape(pv) != ks || ks[0] != ss[0] || ks[1] != kv_heads_)
            fail("past k and v must be [B, Hkv, S, D]");
        const int64_t P = xs[0], B = ss[0], T = ss[1], D = xs[1] / (heads_ + 2 * kv_heads_);
        if (ks[3] != D) fail("past k and v must be [B, Hkv, S, D] with qkv's head size");
        if (D % 8 || D > specrt::ops::kMaxHeadDim) fail("head size must be a multiple of 8, <= 256");
        if (shape(cos) != std::vector<int64_t>{B, T, 1, D} || shape(sin) != shape(cos)) fail("cos and sin must be [B, T, 1, D]");
        if (shape(cells) != std::vector<int64_t>{P}) fail("cells must be [P], one per qkv row");
        if (bs.size() != 5 || bs[0] != B || bs[1] != 1 || bs[2] != 1 || (bs[3] != 1 && bs[3] != T) || bs[4] > ks[2])
            fail("bias must be [B, 1, 1, T or 1, L] with L <= the cache length");
        specrt::ops::AttentionShape s{B, T, heads_, kv_heads_, D, ks[2], bs[4], bs[3], scale_};
        const ONNXTensorElementDataType kt = pk.GetTensorTypeAndShapeInfo().GetElementType();
        if (kt != pv.GetTensorTypeAndShapeInfo().GetElementType()) fail("past k and v must have one element type");
        if (!cache_type_of(kt, &s.cache_type)) fail("past k and v must be float, float16 or bfloat16");
        if (heads_ / kv_heads_ * specrt::ops::kTokensPerTask > 64) fail("more than 32 query heads per KV head");
        // optional inputs 8 and 9: the q and k norms' weights [D] (Qwen3), both or neither
        const float* norms[2] = {nullptr, nullptr};
        for (size_t i = 0; i < 2; ++i) {
            if (ctx.GetInputCount() <= 8 + i) continue;
            Ort::ConstValue w = ctx.GetInput(8 + i);
            if (!w) continue;
            if (shape(w) != std::vector<int64_t>{D}) fail("q_norm and k_norm must be [D]");
            norms[i] = w.GetTensorData<float>();
        }
        if ((norms[0] == nullptr) != (norms[1] == nullptr)) fail("q_norm and k_norm come together");

        Ort::UnownedValue y = ctx.GetOutput(0, {P, heads_ * D});
        Ort::UnownedValue present_k = ctx.GetOutput(1, ks), present_v = ctx.GetOutput(2, ks);
        const size_t cache_bytes = pk.GetTensorTypeAndShapeInfo().GetElementCount() *
                                   (s.cache_type == specrt::ops::CacheType::F32 ? 4 : 2);
        void* k = present_k.GetTensorMutableRawData();
        void* v = present_v.GetTensorMutableRawData();
        if (k != pk.GetTensorRawData()) std::memcpy(k, pk.GetTensorRawData(), cache_bytes);  // not bound in place
        if (v != pv.GetTensorRawData()) std::memcpy(v, pv.GetTensorRawData(), cache_bytes);
        if (P == 0) return;
        if (s.keys == 0) fail("no keys to attend");

        const int64_t grid = B * T, row = heads_ * D;
        const int64_t* at = cells.GetTensorData<int64_t>();
        const int64_t* slot = slots.GetTensorData<int64_t>();
        std::vector<uint8_t> computed(grid, 0);
        for (int64_t i = 0; i < P; ++i) {
            if (at[i] < 0 || at[i] >= grid) fail("cells must index the [B, T] grid of slots");
            if (computed[at[i]]) fail("cells must not repeat a cell");
            if (slot[at[i]] < 0 || slot[at[i]] >= s.cache) fail("a slot is outside the cache");
            computed[at[i]] = 1;
        }
        // per calling thread: the [B, T, H, D] grids the row kernel reads and writes (only the computed cells)
        thread_local std::vector<float> q_grid, out_grid;
        q_grid.resize(grid * row);
        out_grid.resize(grid * row);
        specrt::ops::rope_rows(s, qkv.GetTensorData<float>(), P, at, cos.GetTensorData<float>(),
                               sin.GetTensorData<float>(), slot, q_grid.data(), k, v, norms[0], norms[1], epsilon_);
        const std::vector<specrt::ops::AttentionTask> tasks =
            specrt::ops::attention_plan(s, bias.GetTensorData<float>(), computed.data());
        attend_rows(ctx, isa_, s, tasks, q_grid.data(), bias.GetTensorData<float>(), k, v, out_grid.data());
        float* out = y.GetTensorMutableData<float>();
        for (int64_t i = 0; i < P; ++i) std::memcpy(out + i * row, out_grid.data() + at[i] * row, row * sizeof(float));
    }

private:
    float scale_ = 1.0f, epsilon_ = 1e-6f;
    int64_t heads_ = 0, kv_heads_ = 0;
    specrt::ops::Isa isa_ = specrt::ops::Isa::Scalar;
};

// one registration per cache type (same name, types fixed): ONNX Runtime infers a dynamically typed output from
// a single dynamically typed input only, and past k and v are two
template <ONNXTensorElementDataType Cache>
struct PackedAttentionOp : Ort::CustomOpBase<PackedAttentionOp<Cache>, PackedAttentionKernel> {
    void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const {
        return new PackedAttentionKernel(api, info);
    }
    const char* GetName() const { return "PackedAttention"; }
    const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
    size_t GetInputTypeCount() const { return 10; }
    ONNXTensorElementDataType GetInputType(size_t i) const {
        if (i == 3 || i == 5) return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;  // slots, cells
        return i == 6 || i == 7 ? Cache : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
    }
    OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
        return i >= 8 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;  // q_norm, k_norm
    }
    size_t GetOutputTypeCount() const { return 3; }
    ONNXTensorElementDataType GetOutputType(size_t i) const { return i == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : Cache; }
};

}  // namespace

extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options,
                                                                                          const OrtApiBase* api_base) {
    const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
    if (!api) return nullptr;  // cannot even report: an ONNX Runtime older than these headers
    Ort::InitApi(api);
    static MatMulGGUFOp matmul;
    static GatherGGUFOp gather;
    static RMSNormOp<false> norm;
    static RMSNormOp<true> skip_norm;
    static CacheAttentionOp attention;
    static PackedAttentionOp<ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT> packed_f32;
    static PackedAttentionOp<ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16> packed_f16;
    static PackedAttentionOp<ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16> packed_bf16;
    static std::once_flag once;
    static Ort::CustomOpDomain* domain = nullptr;
    try {
        std::call_once(once, [] {
            domain = new Ort::CustomOpDomain("specrt");  // lives as long as the process: sessions keep using it
            domain->Add(&matmul);
            domain->Add(&gather);
            domain->Add(&norm);
            domain->Add(&skip_norm);
            domain->Add(&attention);
            domain->Add(&packed_f32);
            domain->Add(&packed_f16);
            domain->Add(&packed_bf16);
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
