// One of the kernels' two translation units (cpu_build.py): the layer loops, the operators'
// registration, and the kernels the loops do not call. Each source of ours opens torch's precompiled
// headers, which costs ~3.5 s of CPU per translation unit before any of our code (an empty file, with
// the build's flags, on the 2-core AVX2 EPYC): as fifteen units the sources took 108 s of CPU, as these
// two 42 s (docs/benchmarks.md, session 29). Two, not one, so a build keeps two cores busy.
// The sources of one unit share its file scope: two of them must not define the same file-private
// name (the compiler says so), and the loops' unit holds none of the kernels the loops call, so no
// kernel is inlined into a loop (the loops must compute what the operators compute, bit for bit).
#include "ops.cpp"
#include "../layers/csrc/token_mask.cpp"
#include "../learning/csrc/learned_layers.cpp"
#include "../learning/csrc/sampled_logits.cpp"
#include "../models/csrc/llama_layers.cpp"
#include "../quant/csrc/q4k_search.cpp"
