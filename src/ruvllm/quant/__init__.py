"""Weight quantization: quantized weight records, round-to-nearest quantizers, GGUF block decoding,
and the linear layers that compute with packed int8/int4 weights."""
