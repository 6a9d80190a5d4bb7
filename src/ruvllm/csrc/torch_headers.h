// The torch headers our C++ sources include, compiled once per environment into a precompiled
// header (cpu_build.py, _precompiled_header) that every source is built with (-include). Parsing
// them was ~80% of each source's compile: 5.4 of micro_lora.cpp's 6.6 s of CPU, measured with the
// build's flags; with the precompiled header that source takes 2.5 s, ops.cpp 5.8 instead of 13.8.
// A source that needs another torch header adds it here too (where it is missing, the source still
// builds, parsing that header itself).
#pragma once
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/library.h>
