"""Loading a checkpoint per format: Hugging Face safetensors, GGUF (tensors, quantized blocks, tokenizer), hub ids, MXFP4 experts, tensor-parallel shards."""
