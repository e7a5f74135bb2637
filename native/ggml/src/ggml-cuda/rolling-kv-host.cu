// rolling-KV: the pinned host memory of a streamed tail (GGML_RKV_HOST_ALLOC_PROC, ggml-rolling-kv.h)
//
// A GPU's host tail is read two ways: the copy engine streams it to the device, and the CPU part of a hybrid tail
// (rolling-kv-hybrid.cu) attends its far end on the host. cudaMallocHost's memory serves the first at the link's speed
// but is mapped into the process by the driver page by page; here the tail is anonymous memory of the process, advised
// for 2 MiB pages (transparent huge pages), and registered with the device (cudaHostRegister: pinned, portable to
// every device, mapped: kernels write new K/V rows into it through unified addressing, as into cudaMallocHost's).
// The buffer keeps the device's pinned host buffer type, so the scheduler treats it as any pinned tail.
// ROLLINGKV_TAIL_HOST_MEMORY=cuda keeps cudaMallocHost.

#include "common.cuh"

#include "ggml-backend-impl.h"
#include "ggml-cuda.h"
#include "ggml-rolling-kv.h"
#include "../ggml-rolling-kv-impl.h"

#if defined(__linux__) && !defined(GGML_USE_HIP) && !defined(GGML_USE_MUSA)
#include <sys/mman.h>
#define RKV_HOST_HUGEPAGES 1
#else
#define RKV_HOST_HUGEPAGES 0
#endif

#if RKV_HOST_HUGEPAGES
static void rkv_host_buffer_free(ggml_backend_buffer_t buffer) {
    void * p = buffer->context; // ggml_backend_cpu_buffer_from_ptr's context is the pointer
    if (cudaHostUnregister(p) != cudaSuccess) {
        (void) cudaGetLastError();
    }
    munmap(p, buffer->size);
}
#endif // RKV_HOST_HUGEPAGES

ggml_backend_buffer_t ggml_cuda_rkv_host_buffer_alloc(ggml_backend_dev_t dev, size_t size) {
#if RKV_HOST_HUGEPAGES
    if (ggml_rkv_get_knobs()->tail_cuda_alloc || size == 0) {
        return nullptr;
    }
    // kernels address registered memory by its host pointer only where the device says they can (else the caller
    // falls back to cudaMallocHost, whose pointers always work)
    GGML_UNUSED(dev); // the pinned host buffer type is one for all devices (portable registration)
    for (int device = 0; device < ggml_cuda_info().device_count; ++device) {
        int can_use_host_ptr = 0;
        if (cudaDeviceGetAttribute(&can_use_host_ptr, cudaDevAttrCanUseHostPointerForRegisteredMem, device) !=
                cudaSuccess || !can_use_host_ptr) {
            (void) cudaGetLastError();
            return nullptr;
        }
    }
    const size_t huge = 2u << 20;
    const size_t n = (size + huge - 1)/huge*huge;
    void * p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
        return nullptr;
    }
    madvise(p, n, MADV_HUGEPAGE); // advice only: without THP the pages are 4 KiB and the rest works the same
    // registering faults every page in (and pins it): in 2 MiB pages where the kernel has them
    const cudaError_t err = cudaHostRegister(p, n, cudaHostRegisterPortable | cudaHostRegisterMapped);
    if (err != cudaSuccess) {
        (void) cudaGetLastError();
        GGML_LOG_DEBUG("%s: cannot register %.2f MiB of host memory (%s): the tail uses cudaMallocHost\n", __func__,
            n/1024.0/1024.0, cudaGetErrorString(err));
        munmap(p, n);
        return nullptr;
    }
    ggml_backend_buffer_t buffer = ggml_backend_cpu_buffer_from_ptr(p, n);
    buffer->buft = ggml_backend_cuda_host_buffer_type();
    buffer->iface.free_buffer = rkv_host_buffer_free;
    return buffer;
#else
    GGML_UNUSED(dev);
    GGML_UNUSED(size);
    return nullptr;
#endif // RKV_HOST_HUGEPAGES
}
