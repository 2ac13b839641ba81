"""The settings more than one program takes, declared once (see `radixserve.flags`).

A program's config uses them as field defaults, giving its own default or help where it
differs: `port: int = PORT(50052)`. Imports nothing heavy, so the launcher and the health probe
can use them without torch.
"""

from __future__ import annotations

from radixserve.flags import MAX_PORT, Setting
from radixserve.log_format import LOG_FORMATS, TEXT

DEFAULT_MODEL_DIR = "models/smollm2-135m-instruct"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
AUTO_DTYPE = "auto"
# The dtypes a worker can hold weights and KV pages in (`worker_service.dtypes` maps them).
DTYPE_NAMES = ("float32", "bfloat16", "float16")
DEVICES = ("cpu", "cuda")
# Weight formats a worker can quantize its decoder layers' linear weights to at load time.
QUANTIZATION_NAMES = ("none", "int8", "int4")

HOST = Setting("127.0.0.1", "address to listen on")
PORT = Setting(0, "port to listen on", min=0, max=MAX_PORT)
METRICS_PORT = Setting(0, "port of the Prometheus /metrics endpoint, on --host (0: off)",
                       min=0, max=MAX_PORT)
HTTP_PORT = Setting(8000, "port of the OpenAI-compatible HTTP API, on --host (0: off)",
                    min=0, max=MAX_PORT)
MODEL = Setting(DEFAULT_MODEL_DIR, "model folder (config.json, safetensors, tokenizer), or a GGUF file (or a folder "
                "holding one) served with its quantization, tokenizer and chat template")
DEVICE = Setting(None, "where weights and KV pages live", choices=DEVICES)
DTYPE = Setting(AUTO_DTYPE, "weight and KV dtype; auto: bfloat16 on CUDA or on a CPU with "
                "AVX512-BF16 or AMX, else float32 (the worker reports what it resolved to)",
                choices=(AUTO_DTYPE, *DTYPE_NAMES))
QUANTIZATION = Setting("none", "quantize the decoder layers' linear weights at load time: int8 (per output "
                      "channel, symmetric) or int4 (groups of --quantization-group-size columns with a "
                      "scale and offset); embeddings and LM head stay in --dtype",
                      choices=QUANTIZATION_NAMES)
LM_HEAD_QUANTIZATION = Setting("none", "quantize the LM head (its own copy where tied to the embeddings) to int8 "
                                "per vocabulary row at load time, with --quantization int8 or int4, a GGUF file "
                                "or a GPTQ/AWQ checkpoint; the embeddings stay in --dtype (none: a GGUF file's "
                                "quantized LM head is served as the file holds it)",
                                choices=("none", "int8"))
ACTIVATION_QUANTIZATION = Setting("auto", "int8: the compiled CPU products with quantized weights (decode steps of "
                                   "up to 32 rows, the quantized LM head's too) round each activation row to 8 bits "
                                   "per block of 32 columns and multiply in integers; with quantized weights (int4, "
                                   "int8 in groups of 16 or 32 or per row) and the compiled AVX2 kernels only, "
                                   "refused otherwise (none: float32 activations, the exact product; auto: int8 "
                                   "for a GGUF file's weights where the compiled kernels run, as llama.cpp "
                                   "multiplies them, none otherwise)",
                                   choices=("auto", "none", "int8"))
DETERMINISTIC = Setting(False, "batch- and cache-invariant numerics: a request gets the same tokens and "
                        "logprobs whatever shares its step or its cache, at a given TP size (PyTorch's "
                        "ops on CPU; refused on CUDA, with --attention-kernel native or triton, and with "
                        "--quantization; docs/determinism.md)")
KV_CACHE_MB = Setting(1024, "KV page pool budget of each rank, in MiB (the page count follows)",
                      min=1)
LOG_LEVEL = Setting("INFO", "log level", choices=LOG_LEVELS, parse=str.upper)
LOG_FORMAT = Setting(TEXT, "log lines as text, or as one JSON object each (extra fields as keys)",
                     choices=LOG_FORMATS, parse=str.lower)
CONSTRAINT_CACHE_SIZE = Setting(256, "distinct constraints kept compiled (least recently used "
                                "go first)", min=1)
