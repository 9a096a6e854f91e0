// DataType, ReduceOp and Backend (trun/process_group.h): element sizes, names, which op
// reduces which element type, and parsing a backend's name.

#include <algorithm>
#include <cctype>
#include <stdexcept>
#include <string>

#include "trun/process_group.h"

namespace trun::worker {

size_t dtype_size(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat32:
    case DataType::kInt32:
      return 4;
    case DataType::kFloat64:
    case DataType::kInt64:
      return 8;
    case DataType::kFloat16:
    case DataType::kBFloat16:
      return 2;
    case DataType::kInt8:
    case DataType::kUInt8:
    case DataType::kBool:
      return 1;
  }
  throw std::invalid_argument("unknown DataType " + std::to_string(static_cast<int>(dtype)));
}

const char* dtype_name(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat32:
      return "float32";
    case DataType::kFloat64:
      return "float64";
    case DataType::kFloat16:
      return "float16";
    case DataType::kBFloat16:
      return "bfloat16";
    case DataType::kInt32:
      return "int32";
    case DataType::kInt64:
      return "int64";
    case DataType::kInt8:
      return "int8";
    case DataType::kUInt8:
      return "uint8";
    case DataType::kBool:
      return "bool";
  }
  return "unknown";
}

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kAvg:
      return "avg";
    case ReduceOp::kMin:
      return "min";
    case ReduceOp::kMax:
      return "max";
    case ReduceOp::kProduct:
      return "product";
    case ReduceOp::kBand:
      return "band";
    case ReduceOp::kBor:
      return "bor";
    case ReduceOp::kBxor:
      return "bxor";
  }
  return "unknown";
}

bool reduce_op_supports(ReduceOp op, DataType dtype) {
  const bool integer = dtype == DataType::kInt32 || dtype == DataType::kInt64 ||
                       dtype == DataType::kInt8 || dtype == DataType::kUInt8;
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kMin:
    case ReduceOp::kMax:
    case ReduceOp::kProduct:
      return true;
    case ReduceOp::kAvg:
      return dtype != DataType::kBool;
    case ReduceOp::kBand:
    case ReduceOp::kBor:
    case ReduceOp::kBxor:
      return integer || dtype == DataType::kBool;
  }
  return false;
}

void reduce_op_check(ReduceOp op, DataType dtype, const char* what) {
  (void)dtype_size(dtype);  // throws for an unknown dtype
  if (static_cast<int>(op) < 0 || static_cast<int>(op) > static_cast<int>(ReduceOp::kBxor))
    throw std::invalid_argument(std::string(what) + ": unknown ReduceOp " +
                                std::to_string(static_cast<int>(op)));
  if (!reduce_op_supports(op, dtype))
    throw std::invalid_argument(std::string(what) + ": ReduceOp " + reduce_op_name(op) +
                                " does not apply to " + dtype_name(dtype) +
                                (dtype == DataType::kBool
                                     ? " (avg of booleans is not a boolean)"
                                     : " (bitwise ops take integer or bool elements)"));
}

const char* backend_name(Backend backend) {
  switch (backend) {
    case Backend::kAuto:
      return "auto";
    case Backend::kCpu:
      return "cpu";
    case Backend::kNccl:
      return "nccl";
  }
  return "unknown";
}

Backend parse_backend(const std::string& name) {
  std::string s = name;
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  if (s == "auto") return Backend::kAuto;
  if (s == "cpu" || s == "gloo") return Backend::kCpu;
  if (s == "nccl") return Backend::kNccl;
  throw std::invalid_argument("unknown backend '" + name + "' (expected auto, cpu or nccl)");
}

}  // namespace trun::worker
