"""benchmarks/compile_check.py: its eager stack is the lean forward, bit for bit (rows of at most
MATH_ATTENTION_MAX_LEN tokens with gradients, where both take the math attention kernel), so what
it measures compiled is what sealrl would compile; and its eager digests do not depend on order."""
import torch

from sealrl.models.lean_forward import lean_hidden
from sealrl.models.packing import pack_shared_prompts
from tests.harness import load_benchmark

check = load_benchmark("compile_check")


def test_the_eager_stack_equals_lean_hidden_bitwise():
    model = check.load_causal_lm(check.TINY)[0].train()
    prompts, responses = check.batch(5, 4, 3)
    packed = pack_shared_prompts(prompts, responses, "cpu")
    ids, index = packed.input_ids[0], packed.predicting_index(0)
    expected = lean_hidden(model, ids, packed.lengths, index, packed.rows)
    got = check.step(model, check.stack, prompts, responses)   # its own packing, forward and backward
    assert got.shape == expected.shape == (len(index), model.config.hidden_size)
    assert torch.equal(got, expected)


def test_eager_digests_are_the_same_in_any_order():
    model = check.load_causal_lm(check.TINY)[0].train()
    first = check.digests(model, check.stack, ["1,2,2", "2,5,1"])
    second = check.digests(model, check.stack, ["2,5,1", "1,2,2"])
    assert first == second
    assert first["1,2,2"] != first["2,5,1"]
