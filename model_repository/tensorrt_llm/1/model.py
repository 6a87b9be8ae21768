"""tensorrt_llm (decoupled): TensorRT-LLM's `llmapi` Triton model interface on the ensemble's pipeline.

Thin adapter: the logic is `triton_vlm.triton.llmapi.LlmapiService` (BLS to preprocess, vision and llm) and
`triton_vlm.llmapi` (the tensors' meaning).
"""
from triton_vlm.triton import lifeline

lifeline.exit_with_parent()  # first: a stub never outlives its server, even one that dies while we load

from triton_vlm.triton import config
from triton_vlm.triton.llmapi import LlmapiService, settings_from


class TritonPythonModel:
    def initialize(self, args):
        with lifeline.loading("tensorrt_llm"):  # a failed load ends this stub, whatever threads it started
            self._load(args)

    def _load(self, args):
        config.setup_logging()
        p = config.model_parameters(args)
        self.service = LlmapiService(settings_from(p), workers=config.parse_int(p, "max_concurrency", 64))
        lifeline.settle_heap()  # loaded: no full collection walks the import-time heap again

    def execute(self, requests):
        self.service.execute(requests)
        return None

    def finalize(self):
        self.service.shutdown()
        lifeline.settle_heap()  # the interpreter's exit does not walk the heap (it took 7-10 s)
