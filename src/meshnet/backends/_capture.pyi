"""The C eval callback of llama.cpp shards (_capture.c; used by backends/eval_capture.py)."""

EVAL: int  # the address of meshnet_eval, a ggml_backend_sched_eval_callback
STATE_LAYOUT: tuple[int, int, int]  # sizeof(struct capture), offsetof captured, offsetof overwritten
