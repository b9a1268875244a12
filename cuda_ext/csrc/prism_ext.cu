// Prism's CUDA extension (cuda_ext): compensation kernels, a device slab
// outside torch's caching allocator, and stream-ordered release waits.
// The semantics of every function are those of cuda_ext/reference.py; the
// tests check the two against each other bit for bit.
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda.h>
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <time.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <optional>

namespace {

// ---- compensation: out = own (op) folded, in float32, rounded once ------------
enum Op { SUM = 0, AVG = 1, PREMUL_SUM = 2, MIN = 3, MAX = 4 };

template <typename T> __device__ __forceinline__ float to_f(T x);
template <> __device__ __forceinline__ float to_f<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_f<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ float apply(int op, float a, float b, float factor, float n) {
  switch (op) {
    case SUM: return __fadd_rn(a, b);
    case AVG: return __fdiv_rn(__fadd_rn(a, b), n);
    // two roundings, never contracted into an fma: the reference multiplies, then adds
    case PREMUL_SUM: return __fadd_rn(__fmul_rn(factor, a), b);
    case MIN: return isnan(a) ? a : (isnan(b) ? b : (b < a ? b : a));
    default: return isnan(a) ? a : (isnan(b) ? b : (b > a ? b : a));
  }
}

template <typename T>
__global__ void combine_kernel(T* __restrict__ out, const T* __restrict__ own, const T* __restrict__ folded,
                               int64_t n_elems, int op, float factor, float n) {
  int64_t stride = (int64_t)blockDim.x * gridDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n_elems; i += stride)
    out[i] = from_f<T>(apply(op, to_f<T>(own[i]), to_f<T>(folded[i]), factor, n));
}

// 16-byte vectors where all three pointers allow it (the bandwidth case).
template <typename T>
__global__ void combine_kernel_vec(T* __restrict__ out, const T* __restrict__ own, const T* __restrict__ folded,
                                   int64_t n_vec, int op, float factor, float n) {
  constexpr int K = 16 / sizeof(T);
  int64_t stride = (int64_t)blockDim.x * gridDim.x;
  for (int64_t v = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; v < n_vec; v += stride) {
    uint4 a = reinterpret_cast<const uint4*>(own)[v];
    uint4 b = reinterpret_cast<const uint4*>(folded)[v];
    uint4 r;
    const T* pa = reinterpret_cast<const T*>(&a);
    const T* pb = reinterpret_cast<const T*>(&b);
    T* pr = reinterpret_cast<T*>(&r);
#pragma unroll
    for (int k = 0; k < K; ++k) pr[k] = from_f<T>(apply(op, to_f<T>(pa[k]), to_f<T>(pb[k]), factor, n));
    reinterpret_cast<uint4*>(out)[v] = r;
  }
}

int blocks_for(int64_t work) {
  int dev = 0, sms = 132;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  int64_t b = (work + 255) / 256;
  return (int)std::max<int64_t>(1, std::min<int64_t>(b, (int64_t)sms * 8));
}

template <typename T>
void launch_combine(torch::Tensor out, torch::Tensor own, torch::Tensor folded, int op, float factor, float n) {
  auto stream = c10::cuda::getCurrentCUDAStream();
  int64_t ne = own.numel();
  auto* o = reinterpret_cast<T*>(out.data_ptr());
  auto* a = reinterpret_cast<const T*>(own.data_ptr());
  auto* b = reinterpret_cast<const T*>(folded.data_ptr());
  constexpr int K = 16 / sizeof(T);
  bool aligned = ((uintptr_t)o % 16 == 0) && ((uintptr_t)a % 16 == 0) && ((uintptr_t)b % 16 == 0);
  int64_t nv = aligned ? ne / K : 0;
  if (nv > 0) combine_kernel_vec<T><<<blocks_for(nv), 256, 0, stream>>>(o, a, b, nv, op, factor, n);
  int64_t done = nv * K;
  if (done < ne)
    combine_kernel<T><<<blocks_for(ne - done), 256, 0, stream>>>(o + done, a + done, b + done, ne - done, op,
                                                                   factor, n);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void combine(torch::Tensor out, torch::Tensor own, torch::Tensor folded, int64_t op, double factor, int64_t n) {
  TORCH_CHECK(own.is_cuda() && folded.is_cuda() && out.is_cuda(), "combine: CUDA tensors");
  TORCH_CHECK(own.is_contiguous() && folded.is_contiguous() && out.is_contiguous(), "combine: contiguous tensors");
  TORCH_CHECK(own.numel() == folded.numel() && own.numel() == out.numel(), "combine: sizes differ");
  TORCH_CHECK(own.scalar_type() == folded.scalar_type() && own.scalar_type() == out.scalar_type(),
              "combine: dtypes differ");
  c10::cuda::CUDAGuard guard(own.device());
  float f = (float)factor, nf = (float)n;
  switch (own.scalar_type()) {
    case at::kFloat: launch_combine<float>(out, own, folded, (int)op, f, nf); break;
    case at::kHalf: launch_combine<__half>(out, own, folded, (int)op, f, nf); break;
    case at::kBFloat16: launch_combine<__nv_bfloat16>(out, own, folded, (int)op, f, nf); break;
    default: TORCH_CHECK(false, "combine: the kernels take float32, float16 and bfloat16");
  }
}

// ---- a device slab outside torch's caching allocator -------------------------
torch::Tensor device_slab(int64_t nbytes, int64_t device) {
  c10::cuda::CUDAGuard guard((c10::DeviceIndex)device);
  void* p = nullptr;
  cudaError_t e = cudaMalloc(&p, (size_t)nbytes);
  TORCH_CHECK(e == cudaSuccess, "cuda_ext: cudaMalloc of ", nbytes, " bytes for the prefetch pool failed: ",
              cudaGetErrorString(e));
  auto opts = torch::TensorOptions().dtype(torch::kUInt8).device(torch::kCUDA, device);
  return torch::from_blob(p, {nbytes}, [](void* q) { cudaFree(q); }, opts);
}

// ---- the GIL around calls that queue stream work ------------------------------------
// By default the calls below that queue work on a stream let the GIL go around
// their CUDA calls: a launch or copy may block on a stream's full queue behind a
// release wait whose flag a Python thread flips. In a busy sandbox each such
// release lets another thread take the GIL and the caller waits its turn (1-2
// switches a call on an H100's host, 2026-12-08). set_hold_gil(true) keeps it
// held (an experiment for ranks whose collectives the coordinator releases
// through shared memory, with no Python thread of theirs on the way).
static std::atomic<bool> g_hold_gil{false};

void set_hold_gil(bool hold) { g_hold_gil.store(hold, std::memory_order_relaxed); }

struct MaybeReleaseGil {
  std::optional<pybind11::gil_scoped_release> released;
  MaybeReleaseGil() {
    if (!g_hold_gil.load(std::memory_order_relaxed)) released.emplace();
  }
};

// ---- stream-ordered release ------------------------------------------------------
// flags: a pinned host int32 tensor (mapped: with unified addressing the host
// pointer is the device pointer); stamps: pinned int64, two per slot.
// deadlines: pinned int64, two per slot, written by the host before the flag:
// [0] the earliest globaltimer the wait may end at, [1] a tail: the wait
// ends no sooner than tail ns after the stream reached it. So the release is
// timed on the GPU (no host thread has to wake on time), and a stream that
// gets to a call later than the host said it would still pays the call's
// tail after it got there.
__global__ void wait_kernel(volatile int* flag, int value, unsigned long long* stamp,
                            volatile long long* deadline) {
  unsigned long long t0, t1;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  if (stamp) {
    // The reach, seen by the host while the wait still spins (the rank's
    // watcher reports it to the engine as the call's arrival).
    *(volatile unsigned long long*)stamp = t0;
    __threadfence_system();
  }
  while (*flag < value) {
#if __CUDA_ARCH__ >= 700
    __nanosleep(64);
#endif
  }
  if (deadline) {
    long long d = deadline[0], tail = deadline[1];
    unsigned long long until = (unsigned long long)(d > 0 ? d : 0);
    if (tail > 0 && t0 + (unsigned long long)tail > until) until = t0 + (unsigned long long)tail;
    do {
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
    } while (t1 < until);
  }
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
  if (stamp) *(volatile unsigned long long*)(stamp + 1) = t1;
  __threadfence_system();
}

void wait_flag_kernel(torch::Tensor flags, int64_t slot, int64_t value, torch::Tensor stamps,
                      torch::Tensor deadlines) {
  TORCH_CHECK(flags.is_pinned() && flags.scalar_type() == at::kInt, "wait: flags must be pinned int32");
  auto stream = c10::cuda::getCurrentCUDAStream();
  unsigned long long* st = stamps.numel() ? reinterpret_cast<unsigned long long*>(stamps.data_ptr<int64_t>()) + 2 * slot
                                          : nullptr;
  long long* dl = deadlines.numel() ? reinterpret_cast<long long*>(deadlines.data_ptr<int64_t>()) + 2 * slot : nullptr;
  int* fl = flags.data_ptr<int>() + slot;
  // A launch may block (the stream's queue full behind an earlier wait): the
  // thread that flips the flag needs the GIL, so it is not held meanwhile.
  MaybeReleaseGil no_gil;
  wait_kernel<<<1, 1, 0, stream>>>(fl, (int)value, st, dl);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void wait_flag_memop(torch::Tensor flags, int64_t slot, int64_t value) {
  TORCH_CHECK(flags.is_pinned() && flags.scalar_type() == at::kInt, "wait: flags must be pinned int32");
  auto stream = c10::cuda::getCurrentCUDAStream();
  CUdeviceptr dptr = 0;
  void* host = flags.data_ptr<int>() + slot;
  CUresult r = cuMemHostGetDevicePointer(&dptr, host, 0);
  TORCH_CHECK(r == CUDA_SUCCESS, "cuMemHostGetDevicePointer failed (", (int)r, ")");
  MaybeReleaseGil no_gil;  // as in wait_flag_kernel
  r = cuStreamWaitValue32((CUstream)stream.stream(), dptr, (cuuint32_t)value, CU_STREAM_WAIT_VALUE_GEQ);
  TORCH_CHECK(r == CUDA_SUCCESS, "cuStreamWaitValue32 failed (", (int)r, "); this GPU or driver may not support "
              "stream memory operations: use the wait kernel");
}

__global__ void stamp_kernel(unsigned long long* stamp, volatile int* ack, int value) {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  if (stamp) *stamp = t;
  if (ack) *ack = value;
  __threadfence_system();
}

// Writes the GPU's globaltimer (and, if given, an ack value) when the stream gets here.
void stamp(torch::Tensor stamps, int64_t index, torch::Tensor acks, int64_t ack_slot, int64_t value) {
  auto stream = c10::cuda::getCurrentCUDAStream();
  unsigned long long* st = stamps.numel() ? reinterpret_cast<unsigned long long*>(stamps.data_ptr<int64_t>()) + index
                                          : nullptr;
  int* ak = acks.numel() ? acks.data_ptr<int>() + ack_slot : nullptr;
  MaybeReleaseGil no_gil;  // as in wait_flag_kernel
  stamp_kernel<<<1, 1, 0, stream>>>(st, ak, (int)value);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The host side of a reach watcher: waits, with the GIL released, until
// stamps[a] or stamps[b] is non-zero (a wait kernel's stamp of its stream's
// reach or of its end) or gen[0] differs from seen (a new call to watch),
// checking every period_ns (0: spin), for at most timeout_ns. Returns 0 (a),
// 1 (b), 2 (gen) or -1 (timed out). A watcher polling in Python takes the
// GIL at every check, and each torch op the program's thread makes between
// them then waits to take it back; here the GIL is taken once, on return.
int64_t wait_stamps(torch::Tensor stamps, int64_t a, int64_t b, torch::Tensor gen, int64_t seen, int64_t period_ns,
                    int64_t timeout_ns) {
  TORCH_CHECK(stamps.scalar_type() == at::kLong && !stamps.is_cuda(), "wait_stamps: stamps must be host int64");
  TORCH_CHECK(gen.scalar_type() == at::kLong && !gen.is_cuda() && gen.numel() >= 1, "wait_stamps: gen must be host int64");
  TORCH_CHECK(a < stamps.numel() && b < stamps.numel(), "wait_stamps: index out of range");
  const volatile int64_t* st = stamps.data_ptr<int64_t>();
  const volatile int64_t* g = gen.data_ptr<int64_t>();
  pybind11::gil_scoped_release no_gil;
  const auto start = std::chrono::steady_clock::now();
  const auto limit = std::chrono::nanoseconds(timeout_ns);
  const struct timespec nap = {0, (long)std::max<int64_t>(period_ns, 0)};
  while (true) {
    if (a >= 0 && st[a] != 0) return 0;
    if (b >= 0 && st[b] != 0) return 1;
    if (g[0] != seen) return 2;
    if (std::chrono::steady_clock::now() - start >= limit) return -1;
    if (period_ns > 0) nanosleep(&nap, nullptr);
  }
}

// ---- the prefetch pool's stream work (cuda_ext.PrefetchPool, native path) -------------
// Each is one call from Python where a delivery through torch was ~20 torch
// calls, each slow in a busy rank and each letting the GIL go and waiting to
// take it back. The calls that queue work on a stream let the GIL go once,
// around the CUDA calls: a stream's queue may be full behind a release wait,
// the call then blocks, and the thread that flips the release needs the GIL.
// Events are raw handles (no timing), made once and reused by the pool.

int64_t event_new(int64_t device) {
  c10::cuda::CUDAGuard g((c10::DeviceIndex)device);
  cudaEvent_t e;
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return (int64_t)(intptr_t)e;
}

void event_free(int64_t e) {
  if (e) cudaEventDestroy((cudaEvent_t)(intptr_t)e);
}

// Whether the device's current stream still has work queued (cudaStreamQuery;
// never blocks). torch's current_stream(d).query() from Python builds a Stream
// object each time (part of the 43 us "stream query, charge" stage of a
// device-path call on an H100's host, 2026-12-07).
bool stream_busy(int64_t device) {
  cudaError_t r = cudaStreamQuery(c10::cuda::getCurrentCUDAStream((c10::DeviceIndex)device).stream());
  if (r == cudaSuccess) return false;
  if (r == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return true;
  }
  C10_CUDA_CHECK(r);
  return true;
}

// Whether the stream has passed the event (cudaEventQuery), never blocking.
bool event_done(int64_t e) {
  cudaError_t r = cudaEventQuery((cudaEvent_t)(intptr_t)e);
  if (r == cudaSuccess) return true;
  if (r == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  C10_CUDA_CHECK(r);
  return false;
}

// The host waits for the event (the GIL released meanwhile).
void event_sync(int64_t e) {
  pybind11::gil_scoped_release no_gil;
  C10_CUDA_CHECK(cudaEventSynchronize((cudaEvent_t)(intptr_t)e));
}

// The current stream of `device` waits for event `e` (the GPU waits, not the host).
void stream_wait(int64_t device, int64_t e) {
  c10::cuda::CUDAGuard g((c10::DeviceIndex)device);
  auto stream = c10::cuda::getCurrentCUDAStream((c10::DeviceIndex)device);
  MaybeReleaseGil no_gil;
  C10_CUDA_CHECK(cudaStreamWaitEvent(stream.stream(), (cudaEvent_t)(intptr_t)e, 0));
}

// Records event `e` on the current stream of `device`.
void stream_mark(int64_t device, int64_t e) {
  c10::cuda::CUDAGuard g((c10::DeviceIndex)device);
  auto stream = c10::cuda::getCurrentCUDAStream((c10::DeviceIndex)device);
  MaybeReleaseGil no_gil;
  C10_CUDA_CHECK(cudaEventRecord((cudaEvent_t)(intptr_t)e, stream.stream()));
}

// Fill: nbytes from host address `src` (pinned) to device address `dst`,
// queued on stream `stream` (the pool's side stream), then event `e` recorded there.
void pool_fill(int64_t device, int64_t dst, int64_t src, int64_t nbytes, int64_t stream, int64_t e) {
  c10::cuda::CUDAGuard g((c10::DeviceIndex)device);
  cudaStream_t s = (cudaStream_t)(intptr_t)stream;
  MaybeReleaseGil no_gil;
  C10_CUDA_CHECK(cudaMemcpyAsync((void*)(intptr_t)dst, (const void*)(intptr_t)src, (size_t)nbytes,
                                 cudaMemcpyHostToDevice, s));
  C10_CUDA_CHECK(cudaEventRecord((cudaEvent_t)(intptr_t)e, s));
}

// Delivery: on `out`'s device's current stream, wait for the fill event
// (0: none), copy nbytes from device address `src` into `out` (contiguous,
// of nbytes), then record event `fin` (the block may be reused once the
// stream has passed it).
void pool_deliver(torch::Tensor out, int64_t src, int64_t nbytes, int64_t fill, int64_t fin) {
  TORCH_CHECK(out.is_cuda() && out.is_contiguous(), "pool_deliver: out must be a contiguous CUDA tensor");
  TORCH_CHECK(out.numel() * out.element_size() == nbytes, "pool_deliver: out holds ",
              out.numel() * out.element_size(), " bytes, the block ", nbytes);
  c10::cuda::CUDAGuard g(out.device());
  cudaStream_t s = c10::cuda::getCurrentCUDAStream(out.device().index()).stream();
  void* dst = out.data_ptr();
  MaybeReleaseGil no_gil;
  if (fill) C10_CUDA_CHECK(cudaStreamWaitEvent(s, (cudaEvent_t)(intptr_t)fill, 0));
  C10_CUDA_CHECK(cudaMemcpyAsync(dst, (const void*)(intptr_t)src, (size_t)nbytes,
                                 cudaMemcpyDeviceToDevice, s));
  C10_CUDA_CHECK(cudaEventRecord((cudaEvent_t)(intptr_t)fin, s));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("combine", &combine, "out = own (op) folded, float32 math, rounded once");
  m.def("device_slab", &device_slab, "device memory from cudaMalloc, outside torch's caching allocator");
  m.def("set_hold_gil", &set_hold_gil, "keep the GIL held in the calls that queue stream work (default: released)");
  m.def("wait_flag_kernel", &wait_flag_kernel, "the stream waits (a spinning kernel) until flags[slot] >= value, then until its deadline");
  m.def("wait_flag_memop", &wait_flag_memop, "the stream waits (cuStreamWaitValue32) until flags[slot] >= value");
  m.def("wait_stamps", &wait_stamps, "wait with the GIL released until stamps[a] or stamps[b] is set or gen moves");
  m.def("stamp", &stamp, "write the GPU's globaltimer (and an ack) when the stream reaches this point");
  m.def("event_new", &event_new, "a CUDA event (no timing) on a device, as an integer handle");
  m.def("event_free", &event_free, "destroy an event of event_new");
  m.def("event_done", &event_done, "whether the stream has passed the event (never blocks)");
  m.def("stream_busy", &stream_busy, "whether the device's current stream still has work queued (never blocks)");
  m.def("event_sync", &event_sync, "the host waits for the event, the GIL released");
  m.def("stream_wait", &stream_wait, "the device's current stream waits for the event");
  m.def("stream_mark", &stream_mark, "record the event on the device's current stream");
  m.def("pool_fill", &pool_fill, "host-to-device copy on a stream, then an event recorded there");
  m.def("pool_deliver", &pool_deliver, "on out's current stream: wait for the fill, copy the block in, record fin");
}
