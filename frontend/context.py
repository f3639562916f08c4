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

    @property
    def max_model_len(self) -> int:
        welcome = self.client.welcome
        return welcome.max_model_len if welcome else 2048

    @property
    def block_size(self) -> int:
        welcome = self.client.welcome
        return welcome.runtime.kv_block_size if welcome and welcome.runtime and welcome.runtime.kv_block_size else 16
