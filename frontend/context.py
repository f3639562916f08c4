"""What every endpoint reads: the configuration, the tokenizer, the engine client, the
metrics, the draining flag, and the engine's limits as its ``Welcome`` said them."""

from __future__ import annotations

from frontend.detokenizer import token_bytes_of
from frontend.engine_set import EngineSet
from frontend.metrics import FrontendMetrics
from shared.config import FrontendConfig


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
        # --chat-template FILE replaces the model's template; read once (config.problems checked it is a file)
        self.chat_template: str | None = None
        if config.chat_template:
            with open(config.chat_template, encoding="utf-8") as f:
                self.chat_template = f.read()
        self._tool_template: str | None = None

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
