"""Serve a local model as an OpenAI-compatible chat endpoint on 127.0.0.1 (for the LLM judge, or any client).

    mechprobe serve --model qwen2.5-coder-1.5b-instruct --port 8000
"""

from __future__ import annotations

import argparse

from mechprobe.cli import common
from mechprobe.lm.device import check_device
from mechprobe.lm.models import load_model
from mechprobe.lm.registry import DEFAULT_MODEL
from mechprobe.lm.server import (
    MAX_PROMPT_TOKENS,
    ChatServer,
    HFResponder,
    check_max_new_tokens,
    check_max_prompt_tokens,
    check_port_free,
)

HELP = "serve a local model as an OpenAI-compatible endpoint on 127.0.0.1"


def add_args(p: argparse.ArgumentParser) -> None:
    """Add the serve command's flags to ``p``."""
    p.add_argument("--model", default=None, help="embedded name, HF id/dir or .gguf (default: the embedded default)")
    p.add_argument("--port", type=int, default=8000, help="loopback port to listen on")
    p.add_argument("--max-new-tokens", type=int, default=256, help="cap of each reply (tokens)")
    p.add_argument("--max-prompt-tokens", type=int, default=MAX_PROMPT_TOKENS,
                   help="a longer prompt is refused with a 400 (the model's context caps it too)")
    common.add_device(p)


def run(a: argparse.Namespace) -> int:
    """Check the port, then load the model and serve it on loopback until interrupted."""
    check_max_new_tokens(a.max_new_tokens)
    check_max_prompt_tokens(a.max_prompt_tokens)
    check_device(a.device)
    check_port_free(a.port)
    lm = load_model(a.model or DEFAULT_MODEL, device=a.device)
    srv = ChatServer(HFResponder(lm.model, lm.tokenizer, max_new_tokens=a.max_new_tokens,
                                 max_prompt_tokens=a.max_prompt_tokens), port=a.port,
                     model_name=lm.name, keep_requests=0)  # a long-running server remembers no request
    srv.start()
    print(f"serving {lm.name} at {srv.base_url} (Ctrl-C to stop)", flush=True)
    srv.wait()
    return 0
