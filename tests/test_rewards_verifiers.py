"""Golden cases for the built-in verifiers, the reward model scorer and composition."""
from __future__ import annotations

import pickle
import time

import pytest

from sealrl.rewards import (
    ArithmeticExactMatch,
    CountdownVerifier,
    FormatReward,
    MathVerifier,
    RewardSample,
    WeightedReward,
    answer_text,
    check_raw,
    score_raw,
)
from sealrl.rewards.countdown import MAX_DEPTH, countdown_value


def sample(response: str, truth: object = None, sid: str = "run/0/p/0", prompt: str = "") -> RewardSample:
    return RewardSample(sample_id=sid, prompt=prompt, response=response, ground_truth=truth)


# -- arithmetic exact match --------------------------------------------------------------------

@pytest.mark.parametrize("response, truth, expected", [
    ("42", "42", 1.0),
    ("  42 \n", "42", 1.0),          # surrounding whitespace ignored
    ("42<eos>", "42", 1.0),          # trailing eos text ignored
    ("42 <eos>  ", "42", 1.0),
    ("42", 42, 1.0),                 # int ground truth compares as its decimal string
    ("042", "42", 0.0),              # exact string, not numeric equality
    ("4 2", "42", 0.0),
    ("42<eos>42", "42", 0.0),        # only a trailing eos is removed
    ("", "42", 0.0),
    ("<eos>", "", 1.0),
])
def test_arithmetic_exact_match(response, truth, expected):
    assert ArithmeticExactMatch()(sample(response, truth)) == expected


def test_arithmetic_bad_ground_truth_is_a_scorer_error():
    with pytest.raises(ValueError, match="ground_truth"):
        ArithmeticExactMatch()(sample("1", None))
    [outcome] = score_raw(ArithmeticExactMatch(), [sample("1", [1], sid="a/0/p/3")])
    assert isinstance(outcome, str) and "arithmetic_exact_match" in outcome and "a/0/p/3" in outcome


def test_answer_text():
    assert answer_text(" x <eos>\n") == "x"
    assert answer_text("x</s>", eos_text="</s>") == "x"
    assert answer_text("x<eos>", eos_text="") == "x<eos>"


# -- countdown ---------------------------------------------------------------------------------

CD = {"target": 14, "numbers": [2, 3, 4]}
CD24 = {"target": 24, "numbers": [1, 3, 4, 6]}


@pytest.mark.parametrize("response, truth, expected", [
    ("(3+4)*2", CD, 1.0),              # 7*2 = 14, each number once
    (" ( 3 + 4 ) * 2 <eos>", CD, 1.0),  # whitespace and trailing eos
    ("2*(4+3)", CD, 1.0),              # order of use does not matter
    ("6/(1-3/4)", CD24, 1.0),          # 3/4 -> 1/4 -> 6/(1/4) = 24: fractions reach the target
    ("6/1-3/4", CD24, 0.0),            # 6 - 3/4 = 21/4
    ("4*6*1+3-3", CD24, 0.0),          # reuses 3 (value 24 but 3 used twice)
    ("(3+3)*2", CD, 0.0),              # reuses 3 and leaves 4 unused
    ("7*2", CD, 0.0),                  # 7 is not a given number
    ("2*3+4+4", CD, 0.0),              # 14 with 4 twice
    ("2*3+4", {"target": 10, "numbers": [2, 3, 4, 5]}, 0.0),  # 5 unused: exactly once
    ("(3+4)*2", {"target": 14, "numbers": [2, 3, 4, 4]}, 0.0),
    ("(3+4)*(2)", '{"target": 14, "numbers": [2, 3, 4]}', 1.0),  # JSON string truth
    ("5/(2-2)", {"target": 5, "numbers": [2, 2, 5]}, 0.0),     # division by zero
    ("9**9**9", {"target": 9, "numbers": [9, 9, 9]}, 0.0),     # no powers in the grammar
    ("9^9^9", {"target": 9, "numbers": [9, 9, 9]}, 0.0),
    ("-2+4*4", {"target": 14, "numbers": [2, 4, 4]}, 0.0),     # no unary minus
    ("hello", CD, 0.0),
    ("", CD, 0.0),
    ("(3+4", CD, 0.0),
    ("3+4)*2", CD, 0.0),
    ("(3+4)*2=14", CD, 0.0),           # the answer is the expression only
    ("3 4 2", CD, 0.0),
    ("(3+4)*2.0", CD, 0.0),
    ("(３+4)*2", CD, 0.0),             # full-width digit: ASCII digits only
    ("__import__('os').system('true')", CD, 0.0),
])
def test_countdown(response, truth, expected):
    assert CountdownVerifier()(sample(response, truth)) == expected


def test_countdown_parser_is_exact_and_bounded():
    value, used = countdown_value("6/(1-3/4)")
    assert value == 24 and used == [6, 1, 3, 4]
    assert countdown_value("1/3+1/3+1/3")[0] == 1          # exact, no float round-off
    deep = "(" * (MAX_DEPTH + 1) + "2" + ")" * (MAX_DEPTH + 1)
    assert countdown_value("(" * MAX_DEPTH + "2" + ")" * MAX_DEPTH)[0] == 2
    t0 = time.monotonic()
    assert countdown_value(deep) is None                   # no RecursionError
    assert countdown_value("(" * 100_000 + "2" + ")" * 100_000) is None
    assert countdown_value("9" * 5000) is None             # literal too long, no int() blow-up
    assert time.monotonic() - t0 < 10.0                     # milliseconds; generous for a busy machine


@pytest.mark.parametrize("truth", [None, {"target": "14", "numbers": [2]}, {"target": 14},
                                   {"target": 14, "numbers": []},
                                   {"target": 14, "numbers": [2, True]}, "not json"])
def test_countdown_bad_ground_truth_is_a_scorer_error(truth):
    with pytest.raises(ValueError):
        CountdownVerifier()(sample("(3+4)*2", truth))


# -- math-verify -------------------------------------------------------------------------------

@pytest.mark.parametrize("response, truth, expected", [
    ("The answer is \\boxed{42}.", "42", 1.0),
    ("The answer is \\boxed{41}.", "42", 0.0),
    ("so $\\frac{1}{2}$", "\\frac{1}{2}", 1.0),
    ("\\boxed{0.5}", "$\\frac{1}{2}$", 1.0),            # numeric equality across forms
    ("\\boxed{x(x+2)}", "x^2+2x", 1.0),                 # symbolic equality
    ("\\boxed{\\{2, 1\\}}", "\\{1,2\\}", 1.0),          # sets
    ("\\boxed{\\sqrt{2}}", "\\frac{2}{\\sqrt{2}}", 1.0),
    ("The answer is 42", "42", 0.0),                    # no LaTeX: not extracted (documented)
    ("I don't know", "42", 0.0),
    ("\\boxed{", "42", 0.0),
    ("\\boxed{42}<eos>", 42, 1.0),
])
def test_math_verifier(response, truth, expected):
    assert MathVerifier()(sample(response, truth)) == expected


def test_math_verifier_unparseable_ground_truth_is_a_scorer_error():
    with pytest.raises(ValueError, match="ground_truth"):
        MathVerifier()(sample("\\boxed{1}", "\\frac{"))


# -- format ------------------------------------------------------------------------------------

def test_format_reward():
    fmt = FormatReward(r"<think>.*</think>\s*<answer>.*</answer>")
    assert fmt(sample("<think>a\nb</think> <answer>3</answer><eos>")) == 1.0  # '.' spans lines
    assert fmt(sample("<think>a</think><answer>3</answer> trailing")) == 0.0   # fullmatch
    assert fmt(sample("<answer>3</answer>")) == 0.0
    other = FormatReward(r"\d+")
    assert fmt.version != other.version and fmt.version.startswith("1-")
    assert pickle.loads(pickle.dumps(fmt))(sample("<think></think><answer></answer>")) == 1.0


# -- composition -------------------------------------------------------------------------------

def test_weighted_reward_keeps_raw_components():
    fn = WeightedReward({"correct": (ArithmeticExactMatch(), 1.0),
                         "format": (FormatReward(r"\d+"), 0.5)})
    assert fn(sample("42", "42")) == {"correct": 1.0, "format": 1.0, "total": 1.5}
    assert fn(sample("x", "42")) == {"correct": 0.0, "format": 0.0, "total": 0.0}
    assert fn(sample("41", "42")) == {"correct": 0.0, "format": 1.0, "total": 0.5}
    assert check_raw(fn(sample("41", "42"))) == (0.5, {"correct": 0.0, "format": 1.0})
    assert "arithmetic_exact_match@1*1.0" in fn.version and "format@1-" in fn.version


def test_weighted_reward_nests_and_fails_whole():
    inner = WeightedReward({"a": (ArithmeticExactMatch(), 2.0)}, name="inner")
    outer = WeightedReward({"inner": (inner, 0.5), "fmt": (FormatReward(r"\d+"), 1.0)})
    assert outer(sample("7", "7")) == {"inner": 2.0, "inner/a": 1.0, "fmt": 1.0, "total": 2.0}
    # a component error is the sample's error, never a partial sum
    with pytest.raises(RuntimeError, match="component 'inner'.*component 'a'"):
        outer(sample("7", None))
    [outcome] = score_raw(outer, [sample("7", None, sid="r/1/q/2")])
    assert isinstance(outcome, str) and "'weighted'" in outcome and "r/1/q/2" in outcome


@pytest.mark.parametrize("components", [{}, {"a": (ArithmeticExactMatch(), float("nan"))},
                                        {"total": (ArithmeticExactMatch(), 1.0)},
                                        {"a": (ArithmeticExactMatch(), True)}])
def test_weighted_reward_rejects_bad_config(components):
    with pytest.raises(ValueError):
        WeightedReward(components)


# -- reward model ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rm_folder(tmp_path_factory):
    import torch
    from transformers import LlamaForSequenceClassification

    from sealrl.models.tiny import build_char_tokenizer, tiny_llama_config

    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n"
                               "{% endfor %}")
    config = tiny_llama_config(len(tokenizer), hidden_size=32, num_layers=1, num_heads=2,
                               intermediate_size=64)
    config.num_labels = 1
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config)
    folder = tmp_path_factory.mktemp("rm")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


RM_SAMPLES = [RewardSample(sample_id=f"r/0/p/{i}", prompt=p, response=r)
              for i, (p, r) in enumerate([("1+1=", "2"), ("12+30=", "42<eos>"), ("9*9=", "81"),
                                          ("what is 7?", "seven, I think")])]


def test_reward_model_scorer(rm_folder):
    from sealrl.rewards import RewardModelScorer

    rm = RewardModelScorer(rm_folder, batch_size=3)
    assert rm.format(RM_SAMPLES[0]) == "u:1+1=\na:2\n"      # the RM's own chat template
    single = [rm(s) for s in RM_SAMPLES]
    batch = rm.score_batch(RM_SAMPLES)                         # 2 forward passes: 3 + 1 rows
    assert batch == pytest.approx(single, abs=1e-5)            # right padding: batch == single
    assert len(set(round(x, 6) for x in single)) == len(single)
    again = RewardModelScorer(rm_folder, batch_size=3)         # fresh load: same numbers
    assert again.score_batch(RM_SAMPLES) == batch
    assert again.version == rm.version and len(rm.version) == 12
    clone = pickle.loads(pickle.dumps(rm))                     # pickles without the model
    assert clone._model is None and clone(RM_SAMPLES[1]) == pytest.approx(single[1], abs=1e-6)


def test_reward_model_without_chat_template_concatenates(rm_folder, tmp_path):
    import shutil

    from transformers import AutoTokenizer

    from sealrl.rewards import RewardModelScorer

    plain = tmp_path / "plain"
    shutil.copytree(rm_folder, plain)
    tokenizer = AutoTokenizer.from_pretrained(plain)
    tokenizer.chat_template = None
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    tokenizer.save_pretrained(plain)
    rm = RewardModelScorer(plain)
    assert rm.format(RM_SAMPLES[0]) == "1+1=2"
    assert rm.version != RewardModelScorer(rm_folder).version
    assert rm.score_batch(RM_SAMPLES) == pytest.approx([rm(s) for s in RM_SAMPLES], abs=1e-5)


def test_reward_sample_validates():
    with pytest.raises(ValueError, match="sample_id"):
        RewardSample(sample_id="", prompt="", response="")
    with pytest.raises(ValueError, match="response must be str"):
        RewardSample(sample_id="a/0/p/0", prompt="", response=None)
    with pytest.raises(TypeError):
        RewardSample("a/0/p/0", "", "")  # keyword-only: no positional mix-ups
    ok = RewardSample(sample_id="a/0/p/0", prompt="p", response="r", response_ids=[5, 6])
    assert ok.response_ids == (5, 6) and pickle.loads(pickle.dumps(ok)) == ok
