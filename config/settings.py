"""One typed settings object: every field is a CLI flag (`--kv-cache-memory`) and an environment variable
(`LLMSERVE_KV_CACHE_MEMORY`). Precedence: CLI > environment > default. Defaults run on a laptop CPU."""

import argparse
from pathlib import Path
from typing import Any, Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LLMSERVE_", frozen=True, extra="forbid")

    # Model
    model: str = Field("", description="GGUF file or Hugging Face folder; empty = the embedded default model")
    served_model_name: str = Field("", description="model id in the API; empty = derived from --model")
    models_dir: Path = Field(Path("models"), description="where the default model is cached")
    cache_dir: str = Field(
        str(Path.home() / ".cache" / "llmserve"),
        description="built tokenizers and compiled decode steps, reused by later starts; empty = no cache",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto: bfloat16 on CUDA, float32 on CPU"
    )
    device: str = Field("auto", description="auto, cpu or cuda[:N]")
    quantization: Literal["auto", "none", "int8", "int4"] = Field(
        "auto",
        description="CPU linear layers: auto = the checkpoint's own (a GGUF's Q4_0/Q4_1/Q4_K as int4, Q8_0 as int8), "
        "none = dequantized to --dtype (the exact reference in float32), int8/int4 = requantize every layer",
    )
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="the KV cache's type: auto = float16 on CPU under quantized linears where our kernels are built "
        "(as llama.cpp's default cache; half the memory and reads of float32), else --dtype's; other than --dtype "
        "on CPU only",
    )
    prepack_weights: bool = Field(True, description="CPU: reorder linear weights once for oneDNN (about 2x MKL here)")
    torch_compile: bool = Field(
        True,
        description="CPU: torch.compile the decode step in the background while eager steps serve, switching when "
        "it is ready and no request is running (needs a C++ compiler; kernels cached in --cache-dir)",
    )
    enforce_eager: bool = Field(
        False, description="CUDA: run decode steps eagerly instead of replaying CUDA graphs captured at start-up"
    )
    max_model_len: int = Field(0, description="context length; 0 = the model's own")
    chat_template: str = Field("", description="jinja file overriding the model's chat template")
    num_threads: int = Field(0, description="torch intra-op threads; 0 = torch's default")

    # KV cache and scheduling
    kv_cache_memory: int = Field(
        1024 * 1024 * 1024, description="bytes of KV cache (on CUDA: 0 = use --gpu-memory-utilization)"
    )
    gpu_memory_utilization: float = Field(
        0.9, description="fraction of free CUDA memory for the KV cache when --kv-cache-memory is 0"
    )
    block_size: int = Field(16, description="tokens per KV block")
    max_num_seqs: int = Field(64, description="most sequences in one step")
    max_num_batched_tokens: int = Field(
        512,
        description="most tokens (prefill + decode) in one step; "
        "smaller keeps running streams flowing during long prompts",
    )
    long_prefill_token_threshold: int = Field(
        256,
        ge=0,
        description="a prompt with more tokens than this goes in chunks of at most this many, one such prompt per "
        "step, so running streams keep flowing while it is prefilled; 0: only --max-num-batched-tokens caps them",
    )
    enable_prefix_caching: bool = Field(True, description="reuse KV blocks of earlier prompts with the same prefix")

    speculative_config: str = Field(
        "",
        description='speculative decoding, vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 1}; empty = off',
    )

    # Structured output and tools
    grammar_cache_size: int = Field(
        256, description="compiled grammars (JSON schemas, regexes, tool sets) kept, least recently used evicted"
    )
    tool_call_parser: Literal["auto", "hermes", "llama3_json", "mistral"] = Field(
        "auto", description="tool-call format: auto = the chat template's own, else hermes (<tool_call> tags)"
    )

    # Server
    host: str = Field("127.0.0.1", description="address to bind")
    port: int = Field(8000, description="port to bind")
    api_key: str = Field("", description="Bearer key required on every route but /health; empty = none")
    allowed_origins: list[str] = Field(default_factory=list, description="CORS origins; empty = CORS off")
    max_waiting_requests: int = Field(256, description="waiting requests past which new ones get 429")
    max_waiting_tokens: int = Field(262144, description="prompt tokens waiting past which new requests get 429")
    max_request_bytes: int = Field(2 * 1024 * 1024, description="largest request body; past it 413")
    shutdown_timeout: float = Field(30.0, description="seconds SIGTERM waits for in-flight requests")
    log_level: str = Field("info", description="uvicorn and llmserve log level")
    webui: bool = Field(True, description="serve the chat page at /")

    # Tensor parallelism (README "Scaling out")
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="ranks the model is split over (torch.distributed: NCCL on CUDA, gloo on CPU); rank 0 serves "
        "HTTP and starts the others on this machine, unless torchrun started every rank (RANK, WORLD_SIZE set)",
    )
    distributed_timeout: float = Field(
        60.0, gt=0, description="seconds a collective between ranks may wait before a rank counts as hung or gone"
    )
    cpu_all_reduce: Literal["shm", "gloo"] = Field(
        "shm", description="CPU ranks all on this machine: all-reduce through shared memory (x86) or through gloo"
    )

    @property
    def model_path(self) -> Path:
        from config.default_model import FILENAME

        return Path(self.model) if self.model else self.models_dir / FILENAME

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if not self.model:
            from config.default_model import SERVED_NAME

            return SERVED_NAME
        path = Path(self.model)
        name = path.name
        for suffix in (".gguf", ".GGUF"):
            name = name.removesuffix(suffix)
        return name


def _add_field_arguments(parser: argparse.ArgumentParser) -> None:
    for name, field in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        kind = field.annotation
        if kind is bool:
            parser.add_argument(
                flag,
                dest=name,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=field.description,
            )
        elif kind == list[str]:
            parser.add_argument(flag, dest=name, nargs="*", default=argparse.SUPPRESS, help=field.description)
        else:
            parser.add_argument(
                flag, dest=name, default=argparse.SUPPRESS, help=f"{field.description} (default: {field.default})"
            )


def build_parser(prog: str = "llmserve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="OpenAI-compatible LLM inference server")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="start the HTTP server")
    _add_field_arguments(serve)
    inspect = commands.add_parser("inspect", help="print the model's module tree with shapes and parameter counts")
    inspect.add_argument("model_arg", nargs="?", default=None, metavar="MODEL")
    _add_field_arguments(inspect)
    return parser


def load_settings(argv: list[str] | None = None, **overrides: Any) -> tuple[str, Settings]:
    """Parse `llmserve <command> [flags]`; return the command and the Settings (CLI > env > defaults)."""
    args = vars(build_parser().parse_args(argv))
    command = args.pop("command")
    model_arg = args.pop("model_arg", None)
    if model_arg:
        args["model"] = model_arg
    args.update(overrides)
    return command, Settings(**args)
