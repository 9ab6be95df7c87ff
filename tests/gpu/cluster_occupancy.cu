// Diagnostic (not a test): how many thread-block clusters of 1, 2, 4, 8 CTAs can be resident at once
// on this GPU for a CTA shaped like the weight-gradient kernels (384 threads, 1 CTA per SM by its
// shared memory). A persistent kernel whose grid holds more clusters than this waits for a second wave.
//   nvcc -arch=sm_90a -o /tmp/cluster_occupancy tests/gpu/cluster_occupancy.cu && /tmp/cluster_occupancy
#include <cstdio>
#include <cuda_runtime.h>

__global__ void probe() {}

int main() {
    int smem = 0, sms = 0;
    cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    cudaFuncSetAttribute(probe, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    printf("SMs %d, shared memory per CTA %d bytes\n", sms, smem);
    for (int c = 1; c <= 16; c *= 2) {
        cudaLaunchConfig_t cfg = {};
        cudaLaunchAttribute attr;
        attr.id = cudaLaunchAttributeClusterDimension;
        attr.val.clusterDim.x = c;
        attr.val.clusterDim.y = 1;
        attr.val.clusterDim.z = 1;
        cfg.gridDim = dim3(c * 64, 1, 1);
        cfg.blockDim = dim3(384, 1, 1);
        cfg.dynamicSmemBytes = smem;
        cfg.attrs = &attr;
        cfg.numAttrs = 1;
        int clusters = -1;
        cudaError_t err = cudaOccupancyMaxActiveClusters(&clusters, probe, &cfg);
        printf("cluster size %2d: %3d clusters at once (%3d CTAs) %s\n", c, clusters, clusters * c,
               err == cudaSuccess ? "" : cudaGetErrorString(err));
    }
    return 0;
}
