"""The real Qwen3 tokenizer offline; incremental conversations; tool-call parsing."""

from __future__ import annotations

import socket

import numpy as np
import pytest

from envs.chat import (
    ChatFormat,
    ToolCall,
    ToolCallError,
    format_tool_call,
    load_tokenizer,
    parse_tool_calls,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the corpus.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}},
                "required": ["query"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def chat():
    return ChatFormat(load_tokenizer())  # its own prompt cache


def test_tokenizer_loads_with_the_network_off(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError("network is off in this test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = load_tokenizer.__wrapped__()  # a fresh load, not the process's cached tokenizer
    assert tok.convert_tokens_to_ids("<|im_end|>") == 151645
    assert len(tok) >= 151643
    assert tok.decode(tok.encode("Hello, world!")) == "Hello, world!"


def test_rendered_tool_prompt(chat):
    ids = chat.prompt(
        [{"role": "system", "content": "You are a researcher."}, {"role": "user", "content": "Q?"}],
        tools=TOOLS,
    )
    text = chat.decode(ids)
    assert text.startswith("<|im_start|>system\nYou are a researcher.\n\n# Tools")
    assert '"name": "search"' in text and "<tools>" in text
    assert text.endswith(
        "<|im_start|>user\nQ?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_incremental_conversation_keeps_what_was_sampled(chat):
    messages = [{"role": "system", "content": "Sys."}, {"role": "user", "content": "Find X."}]
    prompt = chat.prompt(messages, tools=TOOLS)
    call = format_tool_call("search", {"query": "X"})
    turn1 = chat.encode(call) + [chat.im_end]  # as if sampled, the stop token included
    obs = chat.observation_ids(["doc 1: X is 42"])
    turn2 = chat.encode("X is 42.") + [chat.im_end]
    ids = prompt + turn1 + obs + turn2
    # Every segment is kept exactly: the ids are the concatenation, and decode in place.
    text = chat.decode(ids)
    assert (
        text == chat.decode(prompt) + call + "<|im_end|>" + chat.decode(obs) + "X is 42.<|im_end|>"
    )
    assert chat.assistant_text(turn1) == call
    # The observation is the template's own tool-response block plus the next generation prompt.
    rendered = chat.tokenizer.apply_chat_template(
        messages
        + [
            {"role": "assistant", "content": call},
            {"role": "tool", "content": "doc 1: X is 42"},
            {"role": "assistant", "content": "X is 42."},
        ],
        tools=TOOLS,
        tokenize=False,
    )
    assert rendered.endswith(chat.decode(obs + turn2) + "\n")
    # Re-rendering is what we never do: the template rewrites the first turn's think block, so a
    # re-tokenised conversation would not match the sampled ids (verl's retokenisation drift).
    assert chat.decode(prompt + turn1) not in rendered


def test_tool_call_round_trip_and_hostile_text():
    text = "Let me look.\n" + format_tool_call("search", {"query": "capital of France"})
    assert parse_tool_calls(text) == [ToolCall("search", {"query": "capital of France"})]
    string_args = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    assert parse_tool_calls(string_args) == [ToolCall("f", {"a": 1})]
    assert parse_tool_calls("no call at all") == []
    bad = {
        "<tool_call>{not json}</tool_call>": "invalid JSON",
        '<tool_call>{"arguments": {}}</tool_call>': "expected",
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>': "JSON object",
        '<tool_call>{"name": "f", "arguments": "{oops"}</tool_call>': "not JSON",
        '<tool_call>{"name": "f"': "unclosed",
        "<tool_call>" + "[" * 100_000 + "</tool_call>": "longer than",
        "<tool_call>" + "[" * 5_000 + "]" * 5_000 + "</tool_call>": "",
    }
    for text, reason in bad.items():
        (result,) = parse_tool_calls(text)
        assert isinstance(result, ToolCallError), text[:40]
        assert reason in result.reason


# -- the checkpoint's own format: the codec against the template's own apply_chat_template ------

# A Qwen3-2507 Instruct-style template: ChatML with tools, no think block anywhere (written here
# as those releases ship it in spirit: the hybrid template without its reasoning handling).
INSTRUCT_2507 = """
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
    {{- '# Tools\\n\\n<tools>' }}
    {%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
    {{- '\\n</tools><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or (messages[loop.index0 - 1].role != 'tool') %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

# A conversation with tools, tool responses (two in one observation) and several turns: each
# entry is (what the model wrote, what the environment answered).
REASONING = ["I should search first.", "Two documents to open.", "", "Now I can answer."]
TURNS = [
    (format_tool_call("search", {"query": "capital of France"}), ["doc1: Paris ..."]),
    (
        format_tool_call("search", {"query": "Paris population"})
        + "\n"
        + format_tool_call("search", {"query": "Paris area"}),
        ["doc2: 2.1 million", "doc3: 105 km2"],
    ),
    ("Paris has 2.1 million people.", None),  # a user follow-up comes next
    ("<answer>Paris</answer>", None),
]
FOLLOW_UP = "And its area?"


def _formats():
    tok = load_tokenizer.__wrapped__()  # an instance of our own: its template is changed below
    tok.chat_template = INSTRUCT_2507
    return {
        "hybrid-thinking-off": ChatFormat(load_tokenizer(), enable_thinking=False),
        "hybrid-thinking-on": ChatFormat(load_tokenizer(), enable_thinking=True),
        "instruct-2507": ChatFormat(tok),
    }


FORMATS = ("hybrid-thinking-off", "hybrid-thinking-on", "instruct-2507")


@pytest.fixture(scope="module")
def formats():
    return _formats()


def _written(name, k):
    """What the model writes on turn k under each format (a thinking model reasons first)."""
    text = TURNS[k][0]
    if name == "hybrid-thinking-on":
        return f"<think>\n{REASONING[k]}\n</think>\n\n{text}"
    return text


def _conversation(chat, name, turns):
    """(the codec's ids of the whole conversation, the chat messages it stands for)."""
    messages = [
        {"role": "system", "content": "You are a researcher."},
        {"role": "user", "content": "Q?"},
    ]
    ids = chat.prompt(messages, tools=TOOLS)
    for k in range(turns):
        written = _written(name, k)
        ids += chat.encode(written) + list(chat.end_of_turn)  # as sampled, the stop included
        messages.append({"role": "assistant", "content": written})
        responses, user = TURNS[k][1] or [], (FOLLOW_UP if TURNS[k][1] is None else None)
        if k == turns - 1:
            break
        ids += chat.observation_ids(responses, user)
        messages += [{"role": "tool", "content": r} for r in responses]
        if user is not None:
            messages.append({"role": "user", "content": user})
    return ids, messages


@pytest.mark.parametrize("name", FORMATS)
def test_every_turn_the_codec_appends_what_the_template_renders(formats, name):
    # At every turn, the context the policy samples from is the template's own rendering of the
    # conversation so far: the codec's prompt, then for each turn the sampled ids and exactly the
    # tokens the template puts between that turn and the next generation prompt.
    chat = formats[name]
    for turns in range(1, len(TURNS)):
        ids, messages = _conversation(chat, name, turns)
        responses, user = TURNS[turns - 1][1] or [], TURNS[turns - 1][1] is None
        history = messages + [{"role": "tool", "content": r} for r in responses]
        if user:
            history.append({"role": "user", "content": FOLLOW_UP})
        rendered = chat.tokenizer.apply_chat_template(
            history, tools=TOOLS, add_generation_prompt=True, tokenize=False,
            enable_thinking=chat.enable_thinking,
        )  # fmt: skip
        last = TURNS[turns - 1][0] + chat.eot_text  # the turn's content, however it is rendered
        segment = rendered[rendered.rindex(last) + len(last) :]
        observation = chat.observation_ids(responses, FOLLOW_UP if user else None)
        assert chat.decode(observation) == segment
        assert observation == chat.encode(segment)
        # and the whole context, rendered once by the template, tokenises to the codec's ids
        if name == "instruct-2507":
            assert ids + observation == chat.encode(rendered)
    first = chat.tokenizer.apply_chat_template(
        messages[:2], tools=TOOLS, add_generation_prompt=True, tokenize=False,
        enable_thinking=chat.enable_thinking,
    )  # fmt: skip
    assert chat.prompt(messages[:2], tools=TOOLS) == chat.encode(first)


@pytest.mark.parametrize("name", FORMATS)
def test_the_whole_conversation_is_the_templates_tokens(formats, name):
    # The template's one rendering of the finished conversation, tokenised, is the codec's ids,
    # wherever the template keeps turns as they were sampled: the 2507 Instruct template always,
    # the hybrid one with thinking on within one user query (turns 0-1). Where the hybrid
    # template does not (it drops the empty <think></think> that thinking-off generation prompts
    # carry, and reasoning before the last user query, when it renders a turn after the fact),
    # the codec keeps what the policy saw when it sampled (token-in/token-out), and the two
    # differ by exactly those blocks.
    chat = formats[name]
    for turns in (2, len(TURNS)):
        ids, messages = _conversation(chat, name, turns)
        rendered = chat.tokenizer.apply_chat_template(
            messages, tools=TOOLS, tokenize=False, enable_thinking=chat.enable_thinking
        )
        expected = chat.encode(rendered.removesuffix("\n"))  # the template's newline after the end
        if name == "instruct-2507" or (name == "hybrid-thinking-on" and turns == 2):
            assert ids == expected
            continue
        text, want = chat.decode(ids), rendered.removesuffix("\n")
        if name == "hybrid-thinking-off":
            empty = "<think>\n\n</think>\n\n"
            assert text.count(empty) == turns and want.count(empty) == 1  # the last turn's
            dropped = text.replace("<|im_start|>assistant\n" + empty, "<|im_start|>assistant\n")
            assert dropped == want.replace(
                "<|im_start|>assistant\n" + empty, "<|im_start|>assistant\n"
            )
        else:  # thinking on, a follow-up question: reasoning before it is dropped by a re-render
            for k in (0, 1):
                assert REASONING[k] in text and REASONING[k] not in want
            assert REASONING[3] in text and REASONING[3] in want


def test_the_codec_reads_the_templates_pieces_and_refuses_what_it_cannot_speak(formats):
    off, on, instruct = (formats[n] for n in FORMATS)
    assert off.generation_prompt == "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert on.generation_prompt == instruct.generation_prompt == "<|im_start|>assistant\n"
    assert off.hybrid and on.hybrid and not instruct.hybrid
    assert off.end_of_turn == (off.tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    assert set(off.stop_ids) == {off.im_end, off.tokenizer.convert_tokens_to_ids("<|endoftext|>")}
    # the environment reads the turn without the stop token and without its reasoning
    turn = on.encode("<think>\nmaybe <answer>x</answer>\n</think>\n\n<answer>y</answer>")
    assert on.turn_text(turn + [on.im_end]) == "<answer>y</answer>"
    from envs.chat import ChatTemplateError

    tok = load_tokenizer.__wrapped__()
    tok.chat_template = INSTRUCT_2507.replace("<|im_end|>", "<|END|>")  # not a token
    with pytest.raises(ChatTemplateError, match=r"ends an assistant turn with '<\|END\|>'"):
        ChatFormat(tok, source="ckpt/tokenizer_config.json")
    tok.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ChatFormat(tok)
    with pytest.raises(ChatTemplateError, match=r"151669 ids but the model has 128 embedding"):
        off.check_vocabulary(128)


def test_a_turn_cut_by_the_budget_or_the_end_of_text_is_closed_and_counted():
    # Row 0 always runs out of tokens, row 1 stops on <|endoftext|>, row 2 ends its turns well:
    # the rollout appends <|im_end|> (not an action) after the first two before the next
    # observation, so the model never continues a half-open turn, and counts them.
    import envs
    from envs.rollout import collect
    from envs.scripted import ScriptedGeneration
    from train.core.trainer import rollout_metrics

    chat = envs.make("search", seed=0).codec
    words = chat.encode(format_tool_call("search", {"query": "capital of France"}))

    class Policy:
        def start(self, prompts):
            pass

        def extend(self, rows):
            self.last = rows

        def generate(self, *, max_new_tokens, active, **_):
            ends = ([], [chat.end_of_text], [chat.im_end])
            out = [(words[: max_new_tokens - len(e)] + e) if a else [] for a, e in
                   zip(active, ends, strict=True)]  # fmt: skip
            return ScriptedGeneration(out, [[0.0] * len(t) for t in out], [False] * 3)

    batch_envs = [envs.make("search", seed=s, max_turns=2) for s in range(3)]
    policy = Policy()
    out = collect(batch_envs, chat, policy, group_ids=[0, 1, 2], max_len=2048, max_new_tokens=8)
    b = out.batch
    for row, closed in ((0, True), (1, True), (2, False)):
        turn0 = np.nonzero(b.turn_ids[row] == 0)[0]
        after = turn0[-1] + 1  # the first token after the sampled turn
        assert (b.tokens[row, after] == chat.im_end and not b.loss_mask[row, after]) == closed
        assert out.episodes[row]["turns_cut"] == (2 if closed else 0)
    assert policy.last[0][0] == chat.im_end  # the cache got the closing token too
    metrics = rollout_metrics(out)
    assert metrics["turn_cut_frac"] == pytest.approx(4 / 6)


# A ChatML template that renders messages only, as SmolLM2's does: the ``tools`` it is given are
# ignored.
CHATML_NO_TOOLS = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _no_tools_format(**kwargs):
    tok = load_tokenizer.__wrapped__()
    tok.chat_template = CHATML_NO_TOOLS
    return ChatFormat(tok, source="smol/tokenizer_config.json", **kwargs)


def test_a_template_that_renders_tools_uses_them(chat):
    assert chat.renders_tools and chat.tools_note() is None
    messages = [{"role": "user", "content": "Q?"}]
    assert chat.with_tools(messages, TOOLS) == messages  # the template's own rendering is used


def test_a_template_without_tools_gets_them_in_the_system_message():
    chat = _no_tools_format()
    assert not chat.renders_tools
    assert (
        "system message" in chat.tools_note() and "smol/tokenizer_config.json" in chat.tools_note()
    )
    for messages in (
        [{"role": "user", "content": "Q?"}],
        [{"role": "system", "content": "You are a researcher."}, {"role": "user", "content": "Q?"}],
    ):
        text = chat.decode(chat.prompt(messages, tools=TOOLS))
        system = text.split("<|im_end|>")[0]
        assert system.startswith("<|im_start|>system\n")
        assert '"name": "search"' in system and "<tools>" in system and "<tool_call>" in system
        if messages[0]["role"] == "system":
            assert system.startswith("<|im_start|>system\nYou are a researcher.\n\n# Tools")
        assert text.endswith("<|im_start|>user\nQ?<|im_end|>\n<|im_start|>assistant\n")
        # without tools nothing is added
        assert "<tools>" not in chat.decode(chat.prompt(messages))
    # the format the block teaches is the one the environments parse
    call = format_tool_call("search", {"query": "x"})
    assert parse_tool_calls(call) == [ToolCall("search", {"query": "x"})]


def test_a_template_without_tools_can_refuse_them():
    from envs.chat import ChatTemplateError

    chat = _no_tools_format(tool_fallback="refuse")
    with pytest.raises(ChatTemplateError, match=r"smol/tokenizer_config.json: the chat template "
                       r"renders no tools, so the 1 tool schemas would be dropped"):  # fmt: skip
        chat.prompt([{"role": "user", "content": "Q?"}], tools=TOOLS)
    assert chat.prompt([{"role": "user", "content": "Q?"}])  # no tools, nothing to refuse
    with pytest.raises(ValueError, match="tool_fallback: 'maybe' is not one of"):
        _no_tools_format(tool_fallback="maybe")


def test_a_run_says_or_refuses_the_fallback_at_start_up(tmp_path, capsys):
    import envs
    from envs.chat import ChatTemplateError
    from train.core.build import run_codec
    from train.core.config import parse_args

    tok = load_tokenizer.__wrapped__()
    tok.chat_template = CHATML_NO_TOOLS
    tok.save_pretrained(tmp_path)
    env = envs.make("search", seed=0)
    cfg = parse_args(["--env", "search", "--tokenizer-path", str(tmp_path)])
    codec = run_codec(cfg, env)
    assert not codec.renders_tools and "system message" in capsys.readouterr().err
    refuse = parse_args(
        ["--env", "search", "--tokenizer-path", str(tmp_path), "--tool-fallback", "refuse"]
    )
    with pytest.raises(ChatTemplateError, match=r"renders no tools.*search has 2 tools"):
        run_codec(refuse, env)
    games = envs.make("guess-the-number", seed=0)  # no tools: nothing to say or refuse
    run_codec(refuse, games)
    assert "renders no tools" not in capsys.readouterr().err
