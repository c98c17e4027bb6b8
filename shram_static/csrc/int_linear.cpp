// Integer dot-product linears for CPU: the ops shram_static::int4_linear and int8_linear.
//
// Each input row is quantized once per call to int8 in blocks of 32 (a float scale amax / 127 per
// block, as llama.cpp's q8_0), and multiplied by 4-bit or 8-bit weights with one fp16 scale per
// block of 32 inputs of an output (q4_0 / q8_0), accumulating each block's products in int32.
// Paths: AVX-512 VNNI, AVX2 and portable C++, chosen per call from the CPU's features (or forced
// by the `isa` argument); the float arithmetic is the same sequence on every path.
//
// Weight layout (made by shram_static/int_kernels.py): outputs in blocks of 16; per block and
// group g of 32 inputs, chunks of 64 bytes, byte 4*o + j of a chunk holding output o:
//   4 bits: 4 chunks; chunk c: low nibble input 8c + j, high nibble input 8c + 4 + j (q + 8).
//   8 bits: 8 chunks; chunk c: input 4c + j (q + 128).
// Scales: (blocks, groups, 16) fp16. The stored weights are unsigned; a block's products are
// corrected by the offset times the sum of the block's int8 activations.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__GNUC__)
#define SHRAM_INLINE inline __attribute__((always_inline))
#else
#define SHRAM_INLINE inline
#endif

#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__)
#include <immintrin.h>
#define SHRAM_X86 1
#endif

namespace {

constexpr int64_t BLK = 32;  // inputs per block
constexpr int64_t LANES = 16;  // outputs per weight block
constexpr int ROWS = 4;  // rows per tile (one weight read per tile)

enum Isa { AUTO = 0, PORTABLE = 1, AVX2 = 2, AVX512_VNNI = 3 };

struct Args {
  const uint8_t* w;  // packed weights
  const uint16_t* s;  // fp16 scales (blocks, G, 16)
  const int8_t* xq;  // (n, Kp) quantized rows
  const float* xd;  // (n, G) row scales
  const int32_t* xs;  // (n, G) sums of each block's xq
  float* y;  // (n, N)
  int64_t n, N, G;
  int bits;
};

inline int32_t load32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline int64_t chunk_bytes(int bits) { return bits == 4 ? 4 * 64 : 8 * 64; }  // per block and group

// Writes a block's 16 results of row r (the last block: only the outputs that exist).
inline void store_row(const Args& a, int64_t ob, int64_t r, const float* v) {
  int64_t o0 = ob * LANES, m = std::min<int64_t>(LANES, a.N - o0);
  std::memcpy(a.y + r * a.N + o0, v, m * sizeof(float));
}

// Row r's quantization: blocks of 32 (zeros past K), scale amax / 127, q = round(x / scale) half
// to even (as torch.round), by adding and subtracting 1.5 * 2^23: exact for |v| <= 127, and a
// loop the compiler vectorizes for each path's ISA (nearbyint is a library call).
SHRAM_INLINE void quantize_rows_body(const float* x, int64_t n, int64_t K, int64_t G,
                                                              int8_t* xq, float* xd, int32_t* xs) {
  constexpr float MAGIC = 12582912.f;
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t g = 0; g < G; ++g) {
      const float* xb = x + r * K + g * BLK;
      int64_t m = std::min<int64_t>(BLK, K - g * BLK);
      float v[BLK];
      for (int64_t k = 0; k < BLK; ++k) v[k] = k < m ? xb[k] : 0.f;
      float amax = 0.f;
      for (int64_t k = 0; k < BLK; ++k) amax = std::max(amax, std::fabs(v[k]));
      float d = amax / 127.f;
      float id = d != 0.f ? 1.f / d : 0.f;
      int8_t* q = xq + r * G * BLK + g * BLK;
      int32_t sum = 0;
      for (int64_t k = 0; k < BLK; ++k) {
        float t = (v[k] * id + MAGIC) - MAGIC;
        t = std::min(127.f, std::max(-127.f, t));
        q[k] = static_cast<int8_t>(static_cast<int32_t>(t));
        sum += q[k];
      }
      xd[r * G + g] = d;
      xs[r * G + g] = sum;
    }
  }
}

void quantize_rows(const float* x, int64_t n, int64_t K, int64_t G, int8_t* xq, float* xd, int32_t* xs) {
  quantize_rows_body(x, n, K, G, xq, xd, xs);
}

template <int R>
void tile_portable(const Args& a, int64_t ob, int64_t r0) {
  const uint8_t* w = a.w + ob * a.G * chunk_bytes(a.bits);
  const uint16_t* s = a.s + ob * a.G * LANES;
  float acc[R][LANES] = {};
  for (int64_t g = 0; g < a.G; ++g) {
    for (int r = 0; r < R; ++r) {
      const int8_t* x = a.xq + (r0 + r) * a.G * BLK + g * BLK;
      int32_t is[LANES] = {};
      if (a.bits == 4) {
        for (int c = 0; c < 4; ++c)
          for (int o = 0; o < LANES; ++o)
            for (int j = 0; j < 4; ++j) {
              uint8_t b = w[(g * 4 + c) * 64 + o * 4 + j];
              is[o] += (b & 15) * x[c * 8 + j] + (b >> 4) * x[c * 8 + 4 + j];
            }
      } else {
        for (int c = 0; c < 8; ++c)
          for (int o = 0; o < LANES; ++o)
            for (int j = 0; j < 4; ++j) is[o] += w[(g * 8 + c) * 64 + o * 4 + j] * x[c * 4 + j];
      }
      int32_t off = (a.bits == 4 ? 8 : 128) * a.xs[(r0 + r) * a.G + g];
      float dx = a.xd[(r0 + r) * a.G + g];
      for (int o = 0; o < LANES; ++o) {
        float dw = static_cast<float>(c10::Half(s[g * LANES + o], c10::Half::from_bits()));
        acc[r][o] = acc[r][o] + static_cast<float>(is[o] - off) * (dw * dx);
      }
    }
  }
  for (int r = 0; r < R; ++r) store_row(a, ob, r0 + r, acc[r]);
}

#ifdef SHRAM_X86

template <int R>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void tile_avx512(const Args& a, int64_t ob, int64_t r0) {
  const uint8_t* w = a.w + ob * a.G * chunk_bytes(a.bits);
  const uint16_t* s = a.s + ob * a.G * LANES;
  const int8_t* x[R];
  __m512 acc[R];
  for (int r = 0; r < R; ++r) {
    x[r] = a.xq + (r0 + r) * a.G * BLK;
    acc[r] = _mm512_setzero_ps();
  }
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const int off = a.bits == 4 ? 8 : 128;
  for (int64_t g = 0; g < a.G; ++g) {
    __m512i i0[R], i1[R];  // two chains per row: the dot products' latency overlaps
    for (int r = 0; r < R; ++r) i0[r] = i1[r] = _mm512_setzero_si512();
    if (a.bits == 4) {
      for (int c = 0; c < 4; ++c) {
        __m512i v = _mm512_loadu_si512(w + (g * 4 + c) * 64);
        __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        for (int r = 0; r < R; ++r) {
          const int8_t* xr = x[r] + g * BLK + c * 8;
          i0[r] = _mm512_dpbusd_epi32(i0[r], lo, _mm512_set1_epi32(load32(xr)));
          i1[r] = _mm512_dpbusd_epi32(i1[r], hi, _mm512_set1_epi32(load32(xr + 4)));
        }
      }
    } else {
      for (int c = 0; c < 8; c += 2) {
        __m512i v0 = _mm512_loadu_si512(w + (g * 8 + c) * 64), v1 = _mm512_loadu_si512(w + (g * 8 + c + 1) * 64);
        for (int r = 0; r < R; ++r) {
          const int8_t* xr = x[r] + g * BLK + c * 4;
          i0[r] = _mm512_dpbusd_epi32(i0[r], v0, _mm512_set1_epi32(load32(xr)));
          i1[r] = _mm512_dpbusd_epi32(i1[r], v1, _mm512_set1_epi32(load32(xr + 4)));
        }
      }
    }
    __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + g * LANES)));
    for (int r = 0; r < R; ++r) {
      int64_t i = (r0 + r) * a.G + g;
      __m512i t = _mm512_sub_epi32(_mm512_add_epi32(i0[r], i1[r]), _mm512_set1_epi32(off * a.xs[i]));
      __m512 sc = _mm512_mul_ps(dw, _mm512_set1_ps(a.xd[i]));
      acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_cvtepi32_ps(t), sc));
    }
  }
  alignas(64) float out[LANES];
  for (int r = 0; r < R; ++r) {
    _mm512_store_ps(out, acc[r]);
    store_row(a, ob, r0 + r, out);
  }
}

template <int R>
__attribute__((target("avx2,f16c"))) void tile_avx2(const Args& a, int64_t ob, int64_t r0) {
  const uint8_t* w = a.w + ob * a.G * chunk_bytes(a.bits);
  const uint16_t* s = a.s + ob * a.G * LANES;
  const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(-128);
  alignas(32) float out[R][LANES];
  for (int h = 0; h < 2; ++h) {  // outputs 8h..8h+7: bytes 32h.. of each chunk
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < a.G; ++g) {
      __m256i is[R];
      if (a.bits == 4) {
        // int16 sums of the block's 8 maddubs per row: at most 8 * 2 * 15 * 127 = 30480
        __m256i s16[R];
        for (int r = 0; r < R; ++r) s16[r] = _mm256_setzero_si256();
        for (int c = 0; c < 4; ++c) {
          __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (g * 4 + c) * 64 + h * 32));
          __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
          for (int r = 0; r < R; ++r) {
            const int8_t* xr = a.xq + (r0 + r) * a.G * BLK + g * BLK + c * 8;
            __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(load32(xr))),
                                         _mm256_maddubs_epi16(hi, _mm256_set1_epi32(load32(xr + 4))));
            s16[r] = _mm256_add_epi16(s16[r], p);
          }
        }
        for (int r = 0; r < R; ++r) {
          __m256i t = _mm256_madd_epi16(s16[r], ones);
          is[r] = _mm256_sub_epi32(t, _mm256_set1_epi32(8 * a.xs[(r0 + r) * a.G + g]));
        }
      } else {
        // signed weights (q + 128 flipped back), |w| times x with w's sign: no int16 saturation
        for (int r = 0; r < R; ++r) is[r] = _mm256_setzero_si256();
        for (int c = 0; c < 8; ++c) {
          __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (g * 8 + c) * 64 + h * 32));
          __m256i ws = _mm256_xor_si256(v, flip), wa = _mm256_abs_epi8(ws);
          for (int r = 0; r < R; ++r) {
            const int8_t* xr = a.xq + (r0 + r) * a.G * BLK + g * BLK + c * 4;
            __m256i xb = _mm256_sign_epi8(_mm256_set1_epi32(load32(xr)), ws);
            is[r] = _mm256_add_epi32(is[r], _mm256_madd_epi16(_mm256_maddubs_epi16(wa, xb), ones));
          }
        }
      }
      __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + g * LANES + h * 8)));
      for (int r = 0; r < R; ++r) {
        __m256 sc = _mm256_mul_ps(dw, _mm256_set1_ps(a.xd[(r0 + r) * a.G + g]));
        acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(_mm256_cvtepi32_ps(is[r]), sc));
      }
    }
    for (int r = 0; r < R; ++r) _mm256_store_ps(out[r] + h * 8, acc[r]);
  }
  for (int r = 0; r < R; ++r) store_row(a, ob, r0 + r, out[r]);
}

#endif

#ifdef SHRAM_X86
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void quantize_rows_avx512(
    const float* x, int64_t n, int64_t K, int64_t G, int8_t* xq, float* xd, int32_t* xs) {
  quantize_rows_body(x, n, K, G, xq, xd, xs);
}

__attribute__((target("avx2,f16c"))) void quantize_rows_avx2(const float* x, int64_t n, int64_t K, int64_t G,
                                                              int8_t* xq, float* xd, int32_t* xs) {
  quantize_rows_body(x, n, K, G, xq, xd, xs);
}
#endif

int best_isa() {
#ifdef SHRAM_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vnni"))
    return AVX512_VNNI;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) return AVX2;
#endif
  return PORTABLE;
}

template <int R>
void tile(int isa, const Args& a, int64_t ob, int64_t r0) {
#ifdef SHRAM_X86
  if (isa == AVX512_VNNI) return tile_avx512<R>(a, ob, r0);
  if (isa == AVX2) return tile_avx2<R>(a, ob, r0);
#endif
  tile_portable<R>(a, ob, r0);
}

at::Tensor int_linear(const at::Tensor& x_, const at::Tensor& packed, const at::Tensor& scale, int64_t N,
                      int64_t isa, int bits) {
  TORCH_CHECK(x_.device().is_cpu() && x_.scalar_type() == at::kFloat, "int", bits,
              "_linear: x must be a float32 CPU tensor, got ", x_.scalar_type(), " on ", x_.device());
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 4 && packed.is_contiguous(),
              "int", bits, "_linear: packed must be a contiguous (blocks, groups, chunks, 64) uint8 tensor");
  int64_t nb = packed.size(0), G = packed.size(1), K = x_.size(-1);
  TORCH_CHECK(packed.size(2) == (bits == 4 ? 4 : 8) && packed.size(3) == 64, "int", bits,
              "_linear: packed has the wrong chunk shape ", packed.sizes());
  TORCH_CHECK(scale.scalar_type() == at::kHalf && scale.is_contiguous() && scale.numel() == nb * G * LANES,
              "int", bits, "_linear: scale must be a contiguous fp16 tensor of ", nb * G * LANES, " values");
  TORCH_CHECK(K <= G * BLK && K > (G - 1) * BLK && N <= nb * LANES && N > (nb - 1) * LANES, "int", bits,
              "_linear: x's width ", K, " or out_features ", N, " does not fit the packed weight ", packed.sizes());
  const int best = best_isa();
  const int use = isa == AUTO ? best : static_cast<int>(isa);
  TORCH_CHECK(use >= PORTABLE && use <= best, "int", bits, "_linear: isa ", isa,
              " is not available on this CPU (best: ", best, ")");
  at::Tensor x = x_.contiguous();
  int64_t n = K ? x.numel() / K : 0;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor y = at::empty(shape, x.options());
  if (n == 0) return y;
  std::vector<int8_t> xq(n * G * BLK);
  std::vector<float> xd(n * G);
  std::vector<int32_t> xs(n * G);
  const float* xp = x.data_ptr<float>();
#ifdef SHRAM_X86
  if (use == AVX512_VNNI)
    quantize_rows_avx512(xp, n, K, G, xq.data(), xd.data(), xs.data());
  else if (use == AVX2)
    quantize_rows_avx2(xp, n, K, G, xq.data(), xd.data(), xs.data());
  else
#endif
    quantize_rows(xp, n, K, G, xq.data(), xd.data(), xs.data());
  Args a{packed.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scale.data_ptr<at::Half>()),
         xq.data(), xd.data(), xs.data(), y.data_ptr<float>(), n, N, G, bits};
  // at least ~32 KB of weights per thread: smaller pieces cost more to hand out than they save
  int64_t grain = std::max<int64_t>(1, (32 << 10) / (G * chunk_bytes(bits)) / std::max<int64_t>(1, n));
  at::parallel_for(0, nb, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t ob = b0; ob < b1; ++ob)
      for (int64_t r0 = 0; r0 < n; r0 += ROWS) {
        switch (std::min<int64_t>(ROWS, n - r0)) {
          case 1: tile<1>(use, a, ob, r0); break;
          case 2: tile<2>(use, a, ob, r0); break;
          case 3: tile<3>(use, a, ob, r0); break;
          default: tile<4>(use, a, ob, r0); break;
        }
      }
  });
  return y;
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, int64_t N,
                       int64_t isa) {
  return int_linear(x, packed, scale, N, isa, 4);
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, int64_t N,
                       int64_t isa) {
  return int_linear(x, packed, scale, N, isa, 8);
}

// The best path on this CPU: 1 portable, 2 AVX2, 3 AVX-512 VNNI.
int64_t best_isa_op() { return best_isa(); }

}  // namespace

TORCH_LIBRARY(shram_static, m) {
  m.def("int4_linear(Tensor x, Tensor packed, Tensor scale, int out_features, int isa=0) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor packed, Tensor scale, int out_features, int isa=0) -> Tensor");
  m.def("int_kernel_isa() -> int", &best_isa_op);
}

TORCH_LIBRARY_IMPL(shram_static, CPU, m) {
  m.impl("int4_linear", &int4_linear);
  m.impl("int8_linear", &int8_linear);
}
