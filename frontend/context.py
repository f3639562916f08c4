"""What every endpoint reads: the configuration, the tokenizer, the engine client, the
metrics, the draining flag, and the engine's limits as its ``Welcome`` said them."""

from __future__ import annotations

import json
from pathlib import Path

from frontend.detokenizer import token_bytes_of
from frontend.engine_set import EngineSet
from frontend.metrics import FrontendMetrics
from shared.config import FrontendConfig


def generation_max_new_tokens(model_dir) -> int | None:
    """``max_new_tokens`` of ``model_dir/generation_config.json``, or ``None`` when it is
    absent, unreadable or not a positive integer (``max_length``, which transformers
    defaults to 20, is not a request's budget and is ignored)."""
    try:
        with open(Path(model_dir) / "generation_config.json") as fh:
            value = json.load(fh).get("max_new_tokens")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


class Frontend:
    """The frontend process's state, shared by its endpoints (one per app)."""

    def __init__(self, config: FrontendConfig, tokenizer, client: EngineSet, model_name: str):
        self.config = config
        self.tokenizer = tokenizer
        self.client = client
        self.model_name = model_name
        self.metrics = FrontendMetrics()
        self.draining = False
        self.vocab_size = len(tokenizer)
        self.token_bytes = token_bytes_of(tokenizer)  # a token id's own bytes, when the tokenizer says
        # max_tokens of a request without one: --default-max-tokens, else the model's generation
        # config (set_model_dir), else None: the endpoint's own default
        self.default_max_tokens: int | None = config.default_max_tokens or None
        # --chat-template FILE replaces the model's template; read once (config.problems checked it is a file)
        self.chat_template: str | None = None
        if config.chat_template:
            with open(config.chat_template, encoding="utf-8") as f:
                self.chat_template = f.read()
        self._tool_template: str | None = None

    def use_generation_config(self, model_dir) -> None:
        """Without ``--default-max-tokens``, take ``max_new_tokens`` from the model's
        ``generation_config.json`` (if it sets one) as the default of a request that omits it."""
        if self.default_max_tokens is None:
            self.default_max_tokens = generation_max_new_tokens(model_dir)

    @property
    def tool_template(self) -> str:
        """The template for conversations with tools: ``--chat-template``'s, else the
        packaged Hermes-style one (frontend/templates/hermes_tools.jinja)."""
        if self.chat_template is not None:
            return self.chat_template
        if self._tool_template is None:
            from frontend.tool_calls import TOOL_TEMPLATE

            self._tool_template = TOOL_TEMPLATE.read_text(encoding="utf-8")
        return self._tool_template

    @property
    def max_model_len(self) -> int:
        welcome = self.client.welcome
        return welcome.max_model_len if welcome else 2048

    @property
    def block_size(self) -> int:
        welcome = self.client.welcome
        return welcome.runtime.kv_block_size if welcome and welcome.runtime and welcome.runtime.kv_block_size else 16
