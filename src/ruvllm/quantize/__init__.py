"""Offline quantization tools: AWQ scale search and folding, SmoothQuant, and writing the results as
checkpoints (`ruvllm quantize`, and the variants `ruvllm download MODEL:int4` converts). They run
once, on calibration text, before serving; the runtime formats they produce are read by ruvllm.quant."""
