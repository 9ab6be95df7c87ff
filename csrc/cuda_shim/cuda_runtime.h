// Minimal stand-in for <cuda_runtime.h>, used only where no CUDA toolkit headers
// are installed (CPU CI). It declares just what the CuTe DSL exported headers and
// the generated launchers use; the definitions come from libcudart_static.a.
#pragma once
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef int cudaError_t;  // enum cudaError in the toolkit: an int-sized C enum
enum { cudaSuccess = 0 };
typedef struct CUstream_st *cudaStream_t;
typedef struct CUlib_st *cudaLibrary_t;

cudaError_t cudaGetDeviceCount(int *count);
cudaError_t cudaGetLastError(void);
const char *cudaGetErrorName(cudaError_t error);
const char *cudaGetErrorString(cudaError_t error);
cudaError_t cudaLibraryUnload(cudaLibrary_t library);

#ifdef __cplusplus
}
#endif
