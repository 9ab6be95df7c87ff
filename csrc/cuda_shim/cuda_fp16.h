// Stand-in for <cuda_fp16.h> (see cuda_runtime.h here): the exported headers include it but use none of it.
#pragma once
