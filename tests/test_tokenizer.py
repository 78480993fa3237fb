"""The tokenizer (the `tokenizers` library and a jinja2 chat template, no transformers) gives the
ids and text transformers' own tokenizer gives for the same model folder."""

import json
import shutil

import pytest
from transformers import AutoTokenizer

from conftest import ours_from_hf, tiny_hf

from specsot_mq.generate import Generator
from specsot_mq.tokenizer import chat_prompt_ids, load_tokenizer

pytestmark = pytest.mark.slow  # the real tokenizer comes with the default model


def folder_with(default_model_dir, tmp_path, **config):
    """A tokenizer folder: the default model's tokenizer, its tokenizer_config.json with `config`
    over it (another chat template, another eos token)."""
    shutil.copy(default_model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    given = json.loads((default_model_dir / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**given, **config}))
    return tmp_path


CHATS = [
    [{"role": "user", "content": "How do I start running?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello.\n\n1. One"}, {"role": "user", "content": "Ünïcödé 🚀 <|im_start|> ok?"}],
]  # fmt: skip
TEXTS = ["", "hello world", " 1. Title\n\n", "日本語のテキスト、絵文字 🚀🔥", "<|im_end|> special inside"]


@pytest.fixture(scope="module")
def both(default_model_dir):
    return load_tokenizer(default_model_dir), AutoTokenizer.from_pretrained(str(default_model_dir))


@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("generation", [True, False])
def test_chat_prompts_are_transformers_ids(both, chat, generation):
    ours, theirs = both
    want = theirs.apply_chat_template(chat, add_generation_prompt=generation, tokenize=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    assert ours.apply_chat_template(chat, add_generation_prompt=generation) == want
    text = theirs.apply_chat_template(chat, add_generation_prompt=generation, tokenize=False)
    assert ours.apply_chat_template(chat, add_generation_prompt=generation, tokenize=False) == text


@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_are_transformers(both, text):
    ours, theirs = both
    for special in (True, False):
        assert ours.encode(text, add_special_tokens=special) == theirs.encode(text, add_special_tokens=special)
    ids = theirs.encode(text) + [theirs.eos_token_id, 1]
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)


def test_special_tokens_and_chat_prompt_ids(both):
    ours, theirs = both
    assert (len(ours), ours.eos_token, ours.eos_token_id, ours.pad_token_id) == (
        len(theirs), theirs.eos_token, theirs.eos_token_id, theirs.pad_token_id)  # fmt: skip
    for chat in CHATS:
        want = theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        assert chat_prompt_ids(ours, chat) == list(want["input_ids"] if hasattr(want, "keys") else want)


# How Qwen3's template (and SmolLM3's) lets the model think first unless told not to.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def test_a_template_that_thinks_first_is_rendered_with_thinking_off(default_model_dir, tmp_path):
    """Every phase's prompt is the answer's own beginning: a model whose template would open a
    think block gets the template's empty one, as transformers renders with enable_thinking=False."""
    folder_with(default_model_dir, tmp_path, chat_template=THINKING_TEMPLATE)
    ours, theirs = load_tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    for chat in CHATS:
        text = ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        assert text == theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=False, enable_thinking=False)
        assert chat_prompt_ids(ours, chat) == theirs.encode(text, add_special_tokens=False)


# How DeepSeek-R1's distills and QwQ open the answer's think block whatever they are given.
FORCED_THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)


def test_a_template_that_forces_a_think_block_open_gets_it_closed(default_model_dir, tmp_path):
    """A reasoning model whose template opens the think block itself would think before every
    phase: its prompts close the block at once, empty, as a thinking-off Qwen3 prompt does; a
    conversation's earlier turns, rendered without a generation prompt, are left as they are."""
    folder_with(default_model_dir, tmp_path, chat_template=FORCED_THINKING_TEMPLATE)
    ours = load_tokenizer(tmp_path)
    for chat in CHATS:
        text = ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") and text.count("<think>") == 1
        assert chat_prompt_ids(ours, chat) == ours.encode(text, add_special_tokens=False)
        assert ours.apply_chat_template(chat, tokenize=False).endswith("<|im_end|>\n")  # nothing added


def test_an_answer_ends_at_any_end_of_turn_token_the_vocabulary_holds(default_model_dir, tmp_path):
    """A file's eos may name one token while its chat ends turns with another (a Llama 3 file's
    <|end_of_text|> and <|eot_id|>): the ids that end an answer are the eos and every special
    end-of-turn token of the vocabulary, whichever the eos is; not the turn's opening token."""
    ours = load_tokenizer(default_model_dir)
    ids = {t: ours.encode(t, add_special_tokens=False)[0] for t in ("<|im_end|>", "<|endoftext|>", "<|im_start|>")}
    assert ours.eos_token == "<|im_end|>" and ours.end_ids == {ids["<|im_end|>"], ids["<|endoftext|>"]}
    other = load_tokenizer(folder_with(default_model_dir, tmp_path, eos_token="<|endoftext|>"))
    assert other.eos_token_id == ids["<|endoftext|>"] and other.end_ids == ours.end_ids
    model = ours_from_hf(tiny_hf("llama", vocab_size=len(other)))  # its config's eos: another token
    assert Generator(model, other, max_len=16).eos_ids == {*model.cfg.eos_token_ids, *ours.end_ids}


# How Mistral's and Llama 2's templates refuse a system message and turns that do not alternate.
STRICT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate') }}{% endif %}"
    "{% if m.role == 'user' %}[INST] {{ m.content }} [/INST]{% else %}{{ m.content }}{{ eos_token }}{% endif %}"
    "{% endfor %}"
)


def test_a_template_that_wants_alternating_turns_gets_them(default_model_dir, tmp_path):
    """A system message goes at the head of the first question and one role's run of messages is
    joined (a point's prompt holds the earlier questions without their answers): every phase's
    prompt renders, as transformers renders the joined conversation; what the template still
    refuses is one clear error."""
    from specsot_mq.errors import SpecSotError
    from specsot_mq.prompts import load_format

    folder_with(default_model_dir, tmp_path, chat_template=STRICT_TEMPLATE)
    ours, theirs = load_tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "user", "content": "And rivers?"}]  # fmt: skip
    joined = [{"role": "user", "content": "Be brief.\n\nHi\n\nAnd rivers?"}]
    want = theirs.apply_chat_template(joined, add_generation_prompt=True, tokenize=False)
    assert chat_prompt_ids(ours, chat) == theirs.encode(want, add_special_tokens=False)
    history = CHATS[1][:3]  # a system message and a turn answered
    fmt = load_format()
    for ids in (fmt.skeleton_ids(ours, "Name rivers.", history), fmt.point_ids(ours, "Name rivers.", "1. Nile", 1, "Nile", history),
                fmt.again_ids(ours, "Name rivers.", 1, "Nile", history)):  # fmt: skip
        assert ours.decode(ids).count("[INST]") >= 1
    with pytest.raises(SpecSotError, match="refuses this conversation .*must alternate"):
        chat_prompt_ids(ours, [{"role": "assistant", "content": "Hello."}])


@pytest.mark.parametrize("template, error", [
    ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% generation %}{{ m.content }}<|im_end|>{% endgeneration %}\n"
     "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}", None),
    ("{% for m in messages %}{{ m.content }{% endfor %}", "cannot be read"),
], ids=["generation-tags", "broken"])  # fmt: skip
def test_a_template_written_for_training_renders_and_a_broken_one_is_one_error(default_model_dir, tmp_path, template, error):
    """A fine-tuned model's template may mark the assistant's words with {% generation %} (for
    training on them alone): rendered as transformers renders it. One that does not parse is one
    error naming it."""
    from specsot_mq.errors import SpecSotError

    folder_with(default_model_dir, tmp_path, chat_template=template)
    ours = load_tokenizer(tmp_path)
    if error:
        with pytest.raises(SpecSotError, match=error):
            chat_prompt_ids(ours, CHATS[0])
        return
    theirs = AutoTokenizer.from_pretrained(str(tmp_path))
    for chat in CHATS:
        text = theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        assert ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == text
        assert chat_prompt_ids(ours, chat) == theirs.encode(text, add_special_tokens=False)
