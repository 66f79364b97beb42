// Where the CUDA glue registers its kernels. In the extension: the real `relpos` ops on the CUDA
// dispatch key. Under the emulator (tests/cuda_emu): the mirror namespace `relpos_emu` on the CPU
// key, so tests call the emulated CUDA kernels on CPU tensors with the ops' own signatures.
#pragma once

#if defined(RELPOS_CUDA_EMU)
#define RELPOS_CUDA_NAMESPACE relpos_emu
#define RELPOS_CUDA_DISPATCH_KEY CPU
#define RELPOS_CUDA_DEVICE_OK(t) ((t).device().is_cpu())
#define RELPOS_CUDA_DEVICE_NAME "cpu (CUDA emulator)"
#else
#define RELPOS_CUDA_NAMESPACE relpos
#define RELPOS_CUDA_DISPATCH_KEY CUDA
#define RELPOS_CUDA_DEVICE_OK(t) ((t).device().is_cuda())
#define RELPOS_CUDA_DEVICE_NAME "cuda"
#endif
