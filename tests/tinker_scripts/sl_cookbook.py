"""tinker-cookbook's supervised loop (tinker_cookbook.supervised.train.main), unmodified, on a small
in-memory arithmetic dataset rendered by the cookbook's own Qwen3 renderer.

    python -m spirl.tinker sl_cookbook.py MODEL_DIR LOG_PATH
"""
import asyncio
import sys

import chz
from tinker_cookbook import renderers
from tinker_cookbook.supervised import train
from tinker_cookbook.supervised.data import conversation_to_datum
from tinker_cookbook.supervised.types import SupervisedDataset, SupervisedDatasetBuilder
from tinker_cookbook.tokenizer_utils import get_tokenizer

MODEL, LOG = sys.argv[1], sys.argv[2]
RENDERER = "qwen3_disable_thinking"
CONVOS = [[{"role": "user", "content": f"What is {a} + {b}?"}, {"role": "assistant", "content": str(a + b)}]
          for a in range(4) for b in range(4)]


class ListDataset(SupervisedDataset):
    def __init__(self, data, batch_size):
        self.data, self.bs = data, batch_size

    def get_batch(self, index):
        return self.data[index * self.bs:(index + 1) * self.bs]

    def __len__(self):
        return len(self.data) // self.bs

    def set_epoch(self, seed: int = 0):
        pass


@chz.chz
class Builder(SupervisedDatasetBuilder):
    model_name: str
    batch_size: int = 4

    def __call__(self):
        r = renderers.get_renderer(RENDERER, get_tokenizer(self.model_name))
        data = [conversation_to_datum(c, r, max_length=512, train_on_what=renderers.TrainOnWhat.LAST_ASSISTANT_MESSAGE)
                for c in CONVOS]
        return ListDataset(data[:12], self.batch_size), ListDataset(data[12:], self.batch_size)


cfg = train.Config(log_path=LOG, model_name=MODEL, recipe_name="sl_test", renderer_name=RENDERER,
                   dataset_builder=Builder(model_name=MODEL), learning_rate=1e-3, lora_rank=4, save_every=2,
                   eval_every=2, max_steps=3)
asyncio.run(train.main(cfg))
