"""Fused layer kernels of the CUDA path (Triton) and the decoder forward that uses them.

- `fused.py`: residual-add + RMSNorm in one kernel, SiLU·mul over the merged gate/up output.
  Rotary + KV write is the attention's (`workers/attention/triton_kernels.rope_write_kv`).
- `fused_llama.py`: `FusedLlama`, the Llama-family forward over those kernels: the CUDA path
  whenever the attention backend is Triton. The CPU path (`LlamaForCausalLM.forward`) is
  untouched by it.
- `dispatch_count.py`: kernels per decode step, counted on meta tensors (no GPU needed).
"""
