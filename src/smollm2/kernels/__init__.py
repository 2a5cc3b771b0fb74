"""CPU kernels (kernels.c), and the torch code each replaces where it is the faster: for decoding, few-row
matrix products and all the transformer blocks of a decoding step in one call; for prompts, float32 matrix
products, the causal attention and the elementwise steps. accelerate() applies them to a model, which owns
what they keep (an Accelerator).

Decoding streams fp32, bf16 and int8 weights at close to the memory's speed, where torch's BLAS calls reach a
fraction of it, with no Python and no thread wake-ups between the ~10 operations of each layer; a float32
model read from a quantized GGUF file (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K) holds those blocks alone, no float32
copy (held.py), and streams them, to the same bits; torch code decodes them on demand (dequantize() for good). A
row's result does not depend on how many rows share the call, a prompt's included. A prompt's attention computes
only the causal half that torch's kernel computes whole, and its RMSNorm, RoPE and SiLU*up take one pass each. The C
source is compiled for this machine on first use (20-60 s, once) into the user's cache; without a working C
compiler everything runs on torch's own kernels, only slower. Everything else (a bf16 prompt's products,
gradients, torch.compile, other devices) runs on torch as well.

Where a kernel is slower than torch's code on this machine, torch's runs instead: the first call of each kind
times both (choosing.py). SMOLLM2_KERNELS=on runs the kernels wherever they can run, =off never; accelerate's
`mode` says it for one model.

    build.py      kernels.c compiled for this machine, once per process
    packed.py     GGUF's blocks in the layout the kernels stream, and decoded from it
    held.py       a float32 matrix held as those blocks alone, decoded on demand
    choosing.py   kernel or torch, measured, for each kind of operation
    ops.py        each kernel beside the torch code it replaces
    accelerate.py the Accelerator, the fast modules, the decoding plan
"""

from .accelerate import Accelerator, accelerate, dequantize, weight_format
from .build import FLAGS, MARCH, SOURCE, build_key, cache_dir, compiled

__all__ = ["FLAGS", "MARCH", "SOURCE", "Accelerator", "accelerate", "build_key", "cache_dir", "compiled",
           "dequantize", "weight_format"]
