"""benchmarks/spec/spec_pair.py's training step: a draft distilled from its target learns the
target's next-token distribution, not only the corpus token."""

from __future__ import annotations

import importlib.util
import os
import sys

import torch

_PATH = os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks", "spec",
                     "spec_pair.py")


def _spec_pair():
    spec = importlib.util.spec_from_file_location("spec_pair_under_test", _PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["spec_pair_under_test"] = mod
    spec.loader.exec_module(mod)
    return mod


def _tiny(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
                      max_position_embeddings=64, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).float()


def _kl(teacher, student, batch) -> float:
    import torch.nn.functional as F

    with torch.no_grad():
        t = F.log_softmax(teacher(input_ids=batch).logits, -1)
        s = F.log_softmax(student(input_ids=batch).logits, -1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean").item()


def test_distilling_moves_the_draft_toward_the_teacher_and_plain_training_does_not():
    sp = _spec_pair()
    teacher = _tiny(0).eval()
    gen = torch.Generator().manual_seed(3)
    data = torch.randint(3, 64, (4096,), generator=gen, dtype=torch.int32)
    probe = data[:33].long()[None]
    kls = {}
    for distill in (0.0, 1.0):
        student = _tiny(1).train()
        opt = sp.make_optimizer(student, 3e-3)
        g = torch.Generator().manual_seed(5)
        before = _kl(teacher, student, probe)
        for _ in range(40):
            batch = data[torch.randint(0, data.numel() - 33, (4,), generator=g)[:, None]
                         + torch.arange(33)[None]].long()
            ce = sp.train_step(student, opt, batch, 3e-3, False, teacher, distill)
            assert ce > 0.0  # the corpus token's cross entropy, whatever the loss
        kls[distill] = (before, _kl(teacher, student, probe))
    (before, after), (_, plain) = kls[1.0], kls[0.0]
    assert after < 0.5 * before  # it learned the teacher's distribution
    assert after < 0.5 * plain  # which random tokens alone do not teach
