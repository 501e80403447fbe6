"""A user's own Hugging Face folder as `model.path`: a byte-level BPE tokenizer trained here with
the `tokenizers` library, a ChatML-like template with system/user/assistant roles, and a tiny
random Llama with GQA and tied embeddings. The prompt token ids must be the template's own
rendering, assembled here by hand from the special-token ids and the raw tokenizer's encoding
of the text between them; a 2-iteration run on it must train on those ids, and its sampled
log-probs must equal the teacher-forced ones. A GPT-NeoX folder (no lean path) trains on the HF
forward, announced in one line.
"""
from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from sealrl.config import UserError, build_config
from sealrl.data.dataset import load_prompts, write_parquet
from sealrl.experience.store import read_iteration
from sealrl.models.hf import load_causal_lm, padding_id, save_causal_lm
from sealrl.models.logprobs import response_log_probs

pytestmark = pytest.mark.slow   # two 2-iteration runs (~20 s in all on one core)

START, END, TEXT_END = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
DEFAULT_SYSTEM = "You are a careful assistant."
# ChatML as instruct models write it; a conversation without a system message gets a default one.
CHATML = ("{% for m in messages %}"
          "{% if loop.first and m['role'] != 'system' %}"
          "{{ '<|im_start|>system\n" + DEFAULT_SYSTEM + "<|im_end|>\n' }}{% endif %}"
          "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CORPUS = ["What is 12 plus 30? The answer is 42.", "Tom has 3 apples and buys 4 more.",
          "system user assistant: you are a careful assistant, answer briefly.",
          "How many wheels do 3 cars have? Each car has 4 wheels, so 12."] * 20
ROWS = [
    [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "What is 3 plus 4?"}],
    [{"role": "user", "content": "Tom has 3 apples and buys 4 more. How many?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 plus 2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 12 plus 30?"}],
]


def build_bpe_tokenizer() -> tuple[Tokenizer, PreTrainedTokenizerFast]:
    """(the raw `tokenizers` object, the transformers tokenizer wrapping it)."""
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=320, special_tokens=[TEXT_END, START, END], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    # no pad token, as in many instruct folders: padding uses the eos id (models/hf.padding_id)
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token=START, eos_token=END)
    hf.chat_template = CHATML
    return raw, hf


@pytest.fixture(scope="module")
def bpe_model_dir(tmp_path_factory):
    raw, tok = build_bpe_tokenizer()
    ids = {t: raw.token_to_id(t) for t in (START, END)}
    config = LlamaConfig(vocab_size=raw.get_vocab_size(), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=True, max_position_embeddings=256,
                         bos_token_id=ids[START], eos_token_id=ids[END])
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    folder = tmp_path_factory.mktemp("bpe") / "model"
    save_causal_lm(model, tok, folder)
    return folder, raw


def expected_prompt(raw: Tokenizer, messages: list[dict]) -> tuple[str, list[int]]:
    """The ChatML text and ids by hand: special tokens by id, the text between them encoded by
    the raw tokenizer on its own (special tokens split the text before BPE runs)."""
    start, end = raw.token_to_id(START), raw.token_to_id(END)
    enc = lambda s: raw.encode(s, add_special_tokens=False).ids
    if messages[0]["role"] != "system":
        messages = [{"role": "system", "content": DEFAULT_SYSTEM}, *messages]
    text, ids = "", []
    for m in messages:
        body = f"{m['role']}\n{m['content']}"
        text += f"{START}{body}{END}\n"
        ids += [start, *enc(body), end, *enc("\n")]
    return text + f"{START}assistant\n", ids + [start, *enc("assistant\n")]


def test_padding_falls_back_to_eos():
    _, tok = build_bpe_tokenizer()
    assert tok.pad_token_id is None and padding_id(tok, "f") == tok.convert_tokens_to_ids(END) == 2
    tok.pad_token = TEXT_END
    assert padding_id(tok, "f") == 0   # trained first, so <|endoftext|> has id 0
    tok.pad_token = tok.eos_token = None
    with pytest.raises(UserError, match="f: the tokenizer has neither a pad nor an eos token"):
        padding_id(tok, "f")


def write_rows(path):
    write_parquet([{"data_source": "toy", "prompt": msgs, "reward_model": {"ground_truth": "7"},
                    "extra_info": {"index": i}} for i, msgs in enumerate(ROWS)], path)
    return path


def test_prompt_ids_are_the_templates_own_rendering(bpe_model_dir, tmp_path):
    folder, raw = bpe_model_dir
    _, tok = load_causal_lm(folder)   # the tokenizer as sealrl loads it from the folder
    prompts = load_prompts(write_rows(tmp_path / "rows.parquet"), tok, max_prompt_tokens=128)
    for p, msgs in zip(prompts, ROWS):
        text, ids = expected_prompt(raw, msgs)
        assert p.text == text
        assert list(p.token_ids) == ids
        assert ids.count(raw.token_to_id(START)) == len(msgs) + 1 + (msgs[0]["role"] != "system")
        assert tok.decode(ids) == text   # byte-level: the ids read back as the very text


def test_two_iterations_train_on_those_ids_with_rollout_parity(bpe_model_dir, tmp_path):
    from sealrl.trainer.driver import train
    folder, raw = bpe_model_dir
    rows = write_rows(tmp_path / "rows.parquet")
    cfg = build_config(None, [
        f"model.path={folder}", "data.task=file", f"data.train_file={rows}", f"data.eval_file={rows}",
        "data.max_prompt_tokens=128", "data.prompts_per_iter=3", "rollout.n=2", "rollout.max_new_tokens=6",
        "algorithm.kl_coef=0.0", "actor.micro_batch_size=6", "run.iterations=2",
        f"run.output_dir={tmp_path}", "run.name=bpe", "run.threads=1", "run.checkpoint_every=1"])
    summary = train(cfg)
    assert summary["completed"] and summary["iterations"] == 2
    expected = {tuple(expected_prompt(raw, msgs)[1]) for msgs in ROWS}
    # iteration 0 sampled from the initial weights, iteration 1 from the policy after iteration
    # 0's update, which checkpoints/step_1/model holds
    policies = [load_causal_lm(folder)[0], load_causal_lm(tmp_path / "bpe/checkpoints/step_1/model")[0]]
    for it, policy in enumerate(policies):
        batch = read_iteration(tmp_path / "bpe" / "experience" / f"iter_{it:06d}.parquet")
        assert {s.prompt_ids for s in batch.samples} == expected   # every row, exactly its ids
        with torch.no_grad():
            lp, _, mask = response_log_probs(policy, [list(s.prompt_ids) for s in batch.samples],
                                             [list(s.response_ids) for s in batch.samples])
        assert mask.sum() > 0 and (batch.get("rollout_log_probs") - lp).abs().max() <= 1e-5
        assert (batch.get("old_log_probs") - lp).abs().max() <= 1e-5


def test_an_architecture_without_the_lean_path_trains_on_the_hf_forward(tmp_path, capsys):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from sealrl.models.tiny import build_char_tokenizer
    from sealrl.trainer.driver import train
    tok = build_char_tokenizer()
    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(GPTNeoXConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2))
    save_causal_lm(model, tok, tmp_path / "neox")
    summary = train(build_config(None, [
        f"model.path={tmp_path / 'neox'}", f"run.output_dir={tmp_path}", "run.name=neox", "run.iterations=2",
        "run.threads=1", "data.num_train=32", "eval.num=4", "data.prompts_per_iter=4",
        "rollout.n=2", "rollout.max_new_tokens=4", "actor.micro_batch_size=8", "algorithm.kl_coef=0.0"]))
    assert summary["completed"]
    notices = [x for x in capsys.readouterr().err.splitlines() if x.startswith("sealrl: rollout runs")]
    assert notices == ["sealrl: rollout runs GPTNeoXForCausalLM on the HF forward, not the lean one "
                       "(model_type 'gpt_neox' is not llama/qwen2); same numbers, slower decoding"]
    batch = read_iteration(tmp_path / "neox" / "experience" / "iter_000001.parquet")
    assert len(batch) == 8   # 4 prompts x 2, sampled on the HF forward (recorded per row)
    table = pq.read_table(tmp_path / "neox" / "experience" / "iter_000001.parquet")
    assert set(table.column("extra.rollout_backend").to_pylist()) == {"HFBackend"}
