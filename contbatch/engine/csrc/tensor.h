// The parts of ATen the kernels use: the tensor type, its factories and at::parallel_for. torch/extension.h would
// bring in all of libtorch's C++ API and pybind11 (about a minute of compile per file against 6-10 s).
#pragma once
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
