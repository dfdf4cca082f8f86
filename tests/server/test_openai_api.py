"""`vireo serve` through the official openai client: completions and chat, streaming and not, usage,
stop sequences, logprobs, and every kind of rejected request (after each of which the server keeps
serving). Greedy outputs are checked against transformers' continuations (tests/fixtures)."""
import json
import os

import openai
import pytest

from conftest import API_KEY, DEMO, Server, demo_cases, demo_server

MODEL = "vireo-demo"
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})


def still_serving(s):
    assert s.http("GET", "/health")[0] == 200
    r = s.client().completions.create(model=MODEL, prompt=[440, 435, 1131], max_tokens=2, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 2


def test_health_models_and_auth(demo):
    assert demo.http("GET", "/health") == (200, b'{"status":"ok"}')
    models = demo.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    # /v1 needs the key; health and metrics do not.
    status, body = demo.http("GET", "/v1/models", auth=False)
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=demo.base + "/v1", api_key="wrong", max_retries=0).models.list()
    assert demo.http("GET", "/metrics", auth=False)[0] == 200
    still_serving(demo)


@pytest.mark.parametrize("case", range(len(demo_cases())))
def test_completions_greedy_equals_transformers(demo, case):
    c = demo_cases()[case]
    r = demo.client().completions.create(model=MODEL, prompt=c["prompt_ids"], max_tokens=48, **GREEDY)
    ch = r.choices[0]
    assert ch.model_extra["token_ids"] == c["continuation_ids"]
    assert ch.text == c["continuation"]
    assert ch.finish_reason == "length"
    assert r.usage.prompt_tokens == len(c["prompt_ids"]) and r.usage.completion_tokens == 48
    assert r.usage.total_tokens == r.usage.prompt_tokens + 48
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.created > 0 and r.model == MODEL


def test_completions_text_prompt_and_streaming(demo):
    c = demo_cases()[2]
    client = demo.client()
    whole = client.completions.create(model=MODEL, prompt=c["prompt"], max_tokens=20, temperature=0)
    assert whole.usage.prompt_tokens == len(c["prompt_ids"])
    assert whole.choices[0].text == client.completions.create(
        model=MODEL, prompt=c["prompt_ids"], max_tokens=20, temperature=0).choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt=c["prompt"], max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == whole.choices[0].text
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == len(c["prompt_ids"])
    assert all(ch.usage is None for ch in chunks[:-1])
    # vLLM's continuous_usage_stats: every chunk carries the choice's usage so far.
    cont = list(client.completions.create(model=MODEL, prompt=c["prompt"], max_tokens=5, temperature=0, stream=True,
                                          stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [ch.usage.completion_tokens for ch in cont if ch.choices]
    assert counts == sorted(counts) and counts[-1] == 5 and all(ch.usage is not None for ch in cont)
    assert cont[-1].usage.completion_tokens == 5 and not cont[-1].choices
    # Without include_usage there is no usage chunk.
    plain = list(client.completions.create(model=MODEL, prompt=c["prompt"], max_tokens=5, temperature=0, stream=True))
    assert all(ch.usage is None and ch.choices for ch in plain)


def test_chat_streaming_equals_non_streaming_and_completions(demo):
    client = demo.client()
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is Unicode?"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=24, temperature=0,
                                       extra_body={"return_token_ids": True})
    ch = r.choices[0]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert ch.message.role == "assistant" and ch.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens == len(ch.model_extra["token_ids"]) <= 24
    assert r.usage.prompt_tokens == len(r.model_extra["prompt_token_ids"])
    # The rendered chat prompt through /v1/completions gives the same tokens.
    same = client.completions.create(model=MODEL, prompt=r.model_extra["prompt_token_ids"], max_tokens=24,
                                     temperature=0, extra_body={"return_token_ids": True})
    assert same.choices[0].model_extra["token_ids"] == ch.model_extra["token_ids"]
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ch.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [ch.finish_reason]
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens
    # Content parts and multi-turn history are accepted.
    multi = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]},
             {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "And?"}]
    assert client.chat.completions.create(model=MODEL, messages=multi, max_tokens=3).usage.completion_tokens <= 3


def test_stop_sequences(demo):
    c = demo_cases()[0]
    cont, client = c["continuation"], demo.client()
    for stop in ["also", "to build.", ["zzz-never", "Python interpreter and"]]:
        first = min(cont.find(s) for s in ([stop] if isinstance(stop, str) else stop) if s in cont)
        r = client.completions.create(model=MODEL, prompt=c["prompt_ids"], max_tokens=48, stop=stop, **GREEDY)
        ch = r.choices[0]
        assert ch.text == cont[:first], stop
        assert ch.finish_reason == "stop"
        # Tokens are counted up to the one that completed the stop string, and no further.
        n = r.usage.completion_tokens
        assert ch.model_extra["token_ids"] == c["continuation_ids"][:n]
        assert n < 48
        chunks = list(client.completions.create(model=MODEL, prompt=c["prompt_ids"], max_tokens=48, stop=stop,
                                                stream=True, temperature=0, stream_options={"include_usage": True}))
        assert "".join(x.choices[0].text for x in chunks if x.choices) == cont[:first]
        assert chunks[-1].usage.completion_tokens == n
    # vLLM's include_stop_str_in_output: the text ends with the stop string, streamed or not.
    first = cont.find("to build.")
    for stream in (False, True):
        kw = dict(model=MODEL, prompt=c["prompt_ids"], max_tokens=48, stop=["to build."], temperature=0,
                  extra_body={"include_stop_str_in_output": True})
        text = ("".join(x.choices[0].text for x in client.completions.create(stream=True, **kw) if x.choices)
                if stream else client.completions.create(**kw).choices[0].text)
        assert text == cont[:first + len("to build.")], stream
    # A stop string that never occurs: the whole continuation, finish_reason length.
    r = client.completions.create(model=MODEL, prompt=c["prompt_ids"], max_tokens=48, stop=["@@@"], **GREEDY)
    assert r.choices[0].text == cont and r.choices[0].finish_reason == "length"


def test_eos_finishes_with_stop(demo):
    # Sampling until the model emits <|endoftext|> (id 8172): finish_reason stop, the EOS not in the text.
    client = demo.client()
    for seed in range(40):
        r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=64, temperature=1.0, seed=seed,
                                      extra_body={"return_token_ids": True})
        ch = r.choices[0]
        if ch.finish_reason == "stop":
            assert ch.model_extra["token_ids"][-1] == 8172 and "<|endoftext|>" not in ch.text
            return
        assert ch.finish_reason == "length" and len(ch.model_extra["token_ids"]) == 64
    pytest.skip("no EOS sampled in 40 seeds")


def test_seeded_sampling_is_reproducible(demo):
    client = demo.client()
    kw = dict(model=MODEL, prompt="The Unicode standard", max_tokens=16, temperature=0.9, top_p=0.9, seed=7,
              extra_body={"top_k": 50, "min_p": 0.01, "ignore_eos": True})
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def penalty_cases():
    with open(os.path.join(os.path.dirname(__file__), "..", "fixtures", "penalties.json")) as f:
        return [c for c in json.load(f)["cases"] if c["model"] == MODEL]


@pytest.mark.parametrize("case", range(4))
def test_penalties_give_transformers_tokens(demo, case):
    """frequency_penalty, presence_penalty (OpenAI's) and repetition_penalty (transformers', vLLM's):
    greedy under them is transformers' continuation (tests/fixtures/penalties.json)."""
    c = penalty_cases()[case]
    extra = {"ignore_eos": True, "return_token_ids": True, "repetition_penalty": c["repetition_penalty"]}
    r = demo.client().completions.create(model=MODEL, prompt=c["prompt"], max_tokens=len(c["new"]), temperature=0,
                                         frequency_penalty=c["frequency_penalty"],
                                         presence_penalty=c["presence_penalty"], extra_body=extra)
    assert r.choices[0].model_extra["token_ids"] == c["new"]


def test_logit_bias(demo):
    """-100 bans the token greedy decoding would pick; +100 makes every pick that token; keys that are
    not token ids, biases out of range and ids past the vocabulary are refused by name. Also vLLM's
    min_tokens, stop_token_ids, allowed_token_ids and bad_words."""
    c = demo_cases()[0]
    client = demo.client()
    first = c["continuation_ids"][0]
    r = client.completions.create(model=MODEL, prompt=c["prompt_ids"], max_tokens=8, logit_bias={str(first): -100},
                                  **GREEDY)
    ids = r.choices[0].model_extra["token_ids"]
    assert first not in ids and len(ids) == 8
    r = client.completions.create(model=MODEL, prompt=c["prompt_ids"], max_tokens=4, logit_bias={"290": 100}, **GREEDY)
    assert r.choices[0].model_extra["token_ids"] == [290] * 4
    # min_tokens (vLLM's) holds back the EOS the bias makes the greedy pick: 3 other tokens first.
    r = client.completions.create(model=MODEL, prompt=c["prompt_ids"], max_tokens=8, temperature=0,
                                  logit_bias={"8172": 100}, extra_body={"return_token_ids": True, "min_tokens": 3})
    assert r.choices[0].model_extra["token_ids"][3:] == [8172] and r.choices[0].finish_reason == "stop"
    # stop_token_ids (vLLM's): the request ends at the first of them it emits; the id is returned,
    # its text is not (vLLM's detokenizer skips a stop token's text unless include_stop_str_in_output).
    cont = c["continuation_ids"]
    detok = lambda ids: json.loads(demo.http("POST", "/detokenize", {"tokens": ids})[1])["prompt"]
    end = cont.index(cont[4])
    for include in (False, True):
        r = client.completions.create(model=MODEL, prompt=c["prompt_ids"], max_tokens=20, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True,
                                                  "stop_token_ids": [cont[4]], "include_stop_str_in_output": include})
        assert r.choices[0].model_extra["token_ids"] == cont[:end + 1]
        assert r.choices[0].text == detok(cont[:end + 1] if include else cont[:end]), r.choices[0].text
        assert r.choices[0].finish_reason == "stop"
    assert detok(cont[:end + 1]) != detok(cont[:end])
    status, err = error_of(demo.http("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "stop_token_ids": [-1]}))
    assert status == 400 and err["param"] == "stop_token_ids", err
    # allowed_token_ids (vLLM's): greedy picks the best of them (the unrestricted pick left out),
    # sampling draws only them; an empty list or an id past the vocabulary is refused by name.
    allowed = [cont[1], cont[3], 290]
    if cont[0] in allowed:
        allowed.remove(cont[0])
    r = client.completions.create(model=MODEL, prompt=c["prompt_ids"], max_tokens=6, logprobs=5,
                                  **{**GREEDY, "extra_body": {**GREEDY["extra_body"], "allowed_token_ids": allowed}})
    got = r.choices[0].model_extra["token_ids"]
    assert set(got) <= set(allowed) and got[0] != cont[0], got
    # (the logprobs stay the model's: the first pick is the best-scored of the allowed ids)
    first_top = r.choices[0].logprobs.top_logprobs[0]
    assert r.choices[0].logprobs.token_logprobs[0] < max(first_top.values())
    r = client.completions.create(model=MODEL, prompt=c["prompt_ids"], max_tokens=12, temperature=1.0, seed=3,
                                  extra_body={"ignore_eos": True, "return_token_ids": True,
                                              "allowed_token_ids": allowed})
    assert set(r.choices[0].model_extra["token_ids"]) <= set(allowed)
    # bad_words (vLLM's): greedy's first word, banned, is not written (at the start or after a space).
    first_word = client.completions.create(model=MODEL, prompt=c["prompt_ids"], max_tokens=1, **GREEDY).choices[0].text
    assert first_word.strip()
    r = client.completions.create(model=MODEL, prompt=c["prompt_ids"], max_tokens=16,
                                  **{**GREEDY, "extra_body": {**GREEDY["extra_body"], "bad_words": [first_word]}})
    assert r.choices[0].model_extra["token_ids"][0] != cont[0]
    assert first_word.strip() not in r.choices[0].text.split(), (first_word, r.choices[0].text)
    for ids_, needle in [([], "not be empty"), ([99999], "out of range"), ("5", "list of token ids")]:
        status, err = error_of(demo.http("POST", "/v1/completions",
                                         {"model": MODEL, "prompt": "x", "allowed_token_ids": ids_}))
        assert status == 400 and err["param"] == "allowed_token_ids" and needle in err["message"], err
    for bias, needle in [({"x": 1}, "not a token id"), ({"5": 101}, "[-100, 100]"), ({"99999": 1}, "out of range"),
                         ([1], "must be an object")]:
        status, err = error_of(demo.http("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": bias}))
        assert status == 400 and err["param"] == "logit_bias" and needle in err["message"], err
    still_serving(demo)


def test_n_choices(demo):
    """n > 1: n choices, choice i sampled as an n = 1 request with seed + i; usage counts the prompt
    once and every choice's tokens; streamed chunks carry each choice's index and add up to the
    whole response's texts; greedy choices are all the same."""
    client = demo.client()
    kw = dict(model=MODEL, prompt="The Unicode standard", max_tokens=12, temperature=0.9, top_p=0.95,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    r = client.completions.create(n=3, seed=40, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    ids = [c.model_extra["token_ids"] for c in r.choices]
    for i in range(3):
        alone = client.completions.create(n=1, seed=40 + i, **kw)
        assert alone.choices[0].model_extra["token_ids"] == ids[i]
    assert len({tuple(x) for x in ids}) > 1  # really sampled apart
    assert r.usage.completion_tokens == 36 and r.usage.prompt_tokens == alone.usage.prompt_tokens
    texts = {}
    finals = {}
    for ch in client.completions.create(n=3, seed=40, stream=True, stream_options={"include_usage": True}, **kw):
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finals[c.index] = c.finish_reason
        if not ch.choices:
            assert ch.usage.completion_tokens == 36
    assert texts == {c.index: c.text for c in r.choices} and finals == {0: "length", 1: "length", 2: "length"}
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                          temperature=0, n=2)
    assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content
    streamed = {}
    for ch in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                             temperature=0, n=2, stream=True):
        for c in ch.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
    assert streamed == {0: chat.choices[0].message.content, 1: chat.choices[1].message.content}
    # Several prompts, n each: choice p * n + i; usage counts each prompt once.
    c0, c1 = demo_cases()[0], demo_cases()[1]
    r = client.completions.create(model=MODEL, prompt=[c0["prompt_ids"], c1["prompt_ids"]], n=2, max_tokens=48,
                                  **GREEDY)
    got = [ch.model_extra["token_ids"] for ch in r.choices]
    assert got == [c0["continuation_ids"]] * 2 + [c1["continuation_ids"]] * 2
    # return_token_ids: each choice names its own prompt's ids (vLLM's), streamed in its first chunk.
    assert [ch.model_extra["prompt_token_ids"] for ch in r.choices] == [c0["prompt_ids"]] * 2 + [c1["prompt_ids"]] * 2
    firsts = {}
    for ch in client.completions.create(model=MODEL, prompt=[c0["prompt_ids"], c1["prompt_ids"]], max_tokens=3,
                                        stream=True, **GREEDY):
        for c in ch.choices:
            if "prompt_token_ids" in c.model_extra:
                assert c.index not in firsts
                firsts[c.index] = c.model_extra["prompt_token_ids"]
    assert firsts == {0: c0["prompt_ids"], 1: c1["prompt_ids"]}
    assert r.usage.prompt_tokens == len(c0["prompt_ids"]) + len(c1["prompt_ids"]) and r.usage.completion_tokens == 192
    status, err = error_of(demo.http("POST", "/v1/completions", {"model": MODEL, "prompt": ["a", 5]}))
    assert status == 400 and err["param"] == "prompt[1]", err
    status, err = error_of(demo.http("POST", "/v1/completions", {"model": MODEL, "prompt": ["a"] * 20, "n": 8}))
    assert status == 400 and err["param"] == "n" and "128 choices" in err["message"], err
    still_serving(demo)


def read_npy_f32(path):
    """A float32 C-order .npy as (shape, flat list): enough for the fixtures (no numpy here)."""
    import ast
    import struct
    with open(path, "rb") as f:
        data = f.read()
    assert data[:6] == b"\x93NUMPY"
    hlen = struct.unpack("<H", data[8:10])[0] if data[6] == 1 else struct.unpack("<I", data[8:12])[0]
    start = (10 if data[6] == 1 else 12) + hlen
    header = ast.literal_eval(data[(10 if data[6] == 1 else 12):start].decode())
    assert header["descr"] == "<f4" and not header["fortran_order"]
    n = 1
    for d in header["shape"]:
        n *= d
    return header["shape"], struct.unpack(f"<{n}f", data[start:start + 4 * n])


def test_echo_holds_a_slice_of_rows_not_the_chunks():
    """echo with logprobs over a 1000-token prompt read in one chunk: its [1000, vocab] logits come
    out of lm_head in slices of 64 rows (the server's bound, GlmDsaModel::set_logit_rows), so the
    process's peak RSS grows by about a slice (2 MB at the demo's vocabulary of 8192), not by the
    chunk's 33 MB twice (the backend's rows and the host's copy), over the same prompt's plain
    request; and the logprobs are the plain request's picks."""
    server = demo_server("--max-batch", "1", "--prefill-chunk", "1024", "--context", "1100")
    try:
        client = server.client()
        prompt = [(37 * i) % 8000 + 100 for i in range(1000)]
        plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
        before = server.rss_bytes("VmHWM")
        echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, echo=True, logprobs=1,
                                           temperature=0)
        grown = server.rss_bytes("VmHWM") - before
        lp = echoed.choices[0].logprobs
        assert len(lp.tokens) == 1001 and lp.token_logprobs[0] is None
        assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
        assert echoed.choices[0].text.endswith(plain.choices[0].text)
        assert grown < 16 << 20, f"peak RSS grew {grown / 2**20:.1f} MiB for the echo"
    finally:
        server.stop()


def test_echo_scores_the_prompt(demo):
    """echo with logprobs and max_tokens 0 (lm-eval's loglikelihood request): the text is the prompt's,
    the first token has no logprob, every other one the log-softmax of transformers' teacher-forced
    logits at the position before (tests/fixtures/demo/logits.npy); with tokens asked for they follow
    the prompt's, as the plain request's; echo streams the prompt's text first."""
    import math
    with open(os.path.join(os.path.dirname(__file__), "..", "fixtures", "demo", "expected.json")) as f:
        ids = json.load(f)["logits"]["token_ids"][:40]
    (_, V), flat = read_npy_f32(os.path.join(os.path.dirname(__file__), "..", "fixtures", "demo", "logits.npy"))
    client = demo.client()
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=2, temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "length" and r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    lp = ch.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    worst = 0.0
    for i in range(1, len(ids)):
        row = flat[(i - 1) * V:i * V]
        mx = max(row)
        lse = mx + math.log(sum(math.exp(x - mx) for x in row))
        worst = max(worst, abs(lp.token_logprobs[i] - (row[ids[i]] - lse)))
        assert len(lp.top_logprobs[i]) == 2 and max(lp.top_logprobs[i].values()) >= lp.token_logprobs[i] - 1e-6
    assert worst < 1e-3, worst
    assert lp.text_offset == sorted(lp.text_offset) and ch.text == "".join(lp.tokens)
    c = demo_cases()[0]
    plain = client.completions.create(model=MODEL, prompt=c["prompt"], max_tokens=6, **GREEDY)
    echoed = client.completions.create(model=MODEL, prompt=c["prompt"], max_tokens=6, echo=True, logprobs=1, **GREEDY)
    assert echoed.choices[0].text == c["prompt"] + plain.choices[0].text
    assert echoed.choices[0].model_extra["token_ids"] == plain.choices[0].model_extra["token_ids"]
    elp = echoed.choices[0].logprobs
    assert len(elp.tokens) == len(c["prompt_ids"]) + 6 and elp.text_offset[len(c["prompt_ids"])] == len(c["prompt"])
    chunks = list(client.completions.create(model=MODEL, prompt=c["prompt"], max_tokens=6, echo=True, stream=True,
                                            **GREEDY))
    assert chunks[0].choices[0].text == c["prompt"]
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == echoed.choices[0].text
    status, err = error_of(demo.http("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}))
    assert status == 400 and err["param"] == "max_tokens", err
    # A list of prompts (lm-eval batches its loglikelihood requests so): one choice each, in order.
    batch = client.completions.create(model=MODEL, prompt=[ids[:10], ids[:25], c["prompt"]], max_tokens=0, echo=True,
                                      logprobs=0, temperature=0)
    assert [ch.index for ch in batch.choices] == [0, 1, 2]
    assert batch.choices[1].logprobs.token_logprobs[:10] == batch.choices[0].logprobs.token_logprobs
    assert batch.choices[1].logprobs.token_logprobs == lp.token_logprobs[:25]
    assert batch.choices[2].text == c["prompt"]
    assert batch.usage.prompt_tokens == 10 + 25 + len(c["prompt_ids"]) and batch.usage.completion_tokens == 0


def test_truncate_prompt_tokens(demo):
    """vLLM's truncate_prompt_tokens keeps a prompt's last k tokens: the reply, its usage and its echo
    are those of the truncated prompt sent as it is; -1 keeps what leaves room for one token."""
    c = demo_cases()[3]
    ids = c["prompt_ids"]
    client = demo.client()
    k = 12
    assert len(ids) > k
    cut = client.completions.create(model=MODEL, prompt=c["prompt"], max_tokens=8, echo=True,
                                    **{**GREEDY, "extra_body": {**GREEDY["extra_body"], "truncate_prompt_tokens": k}})
    plain = client.completions.create(model=MODEL, prompt=ids[-k:], max_tokens=8, echo=True, **GREEDY)
    whole = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, **GREEDY)
    assert cut.usage.prompt_tokens == k
    assert cut.model_extra["prompt_token_ids"] == ids[-k:]
    assert cut.choices[0].model_extra["token_ids"] == plain.choices[0].model_extra["token_ids"]
    assert cut.choices[0].text == plain.choices[0].text  # the echo is the truncated prompt's text
    assert not cut.choices[0].text.startswith(c["prompt"])
    # A longer k leaves the prompt whole; chat truncates the rendered conversation.
    same = client.completions.create(model=MODEL, prompt=ids, max_tokens=8,
                                     **{**GREEDY, "extra_body": {**GREEDY["extra_body"], "truncate_prompt_tokens": 200}})
    assert same.choices[0].model_extra["token_ids"] == whole.choices[0].model_extra["token_ids"]
    msgs = [{"role": "user", "content": "Tell me a story about a dragon and a knight."}]
    full = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1, temperature=0)
    chat_cut = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1, temperature=0,
                                              extra_body={"truncate_prompt_tokens": 6})
    assert full.usage.prompt_tokens > 6 and chat_cut.usage.prompt_tokens == 6
    # -1: a prompt longer than the context keeps its last context - 1 tokens (refused without it).
    ctx = json.loads(demo.http("POST", "/tokenize", {"model": MODEL, "prompt": "x"})[1])["max_model_len"]
    long_ids = (ids * (ctx // len(ids) + 2))[:ctx + 20]
    status, err = error_of(demo.http("POST", "/v1/completions", {"model": MODEL, "prompt": long_ids, "max_tokens": 1}))
    assert status == 400 and err["param"] == "prompt", err
    r = client.completions.create(model=MODEL, prompt=long_ids, max_tokens=1, temperature=0,
                                  extra_body={"truncate_prompt_tokens": -1})
    assert r.usage.prompt_tokens == ctx - 1 and r.usage.completion_tokens == 1


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def test_tools_are_described_and_calls_rendered(demo):
    """tools reach the chat template (the prompt grows by their description; tool_choice none leaves
    them out), earlier assistant tool calls (arguments as a JSON string) and tool results render,
    and bad tools are refused by name. A generation cut off inside a call returns no tool_calls."""
    client = demo.client()
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    plain = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1, temperature=0)
    with_tools = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1, temperature=0, tools=[WEATHER])
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 20
    none = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1, temperature=0, tools=[WEATHER],
                                          tool_choice="none")
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    turn = msgs + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r = client.chat.completions.create(model=MODEL, messages=turn, max_tokens=4, temperature=0, tools=[WEATHER])
    assert r.usage.prompt_tokens > with_tools.usage.prompt_tokens and r.choices[0].finish_reason == "length"
    # Text before any call streams as it comes (not held to the end), the same text as without streaming.
    kw = dict(model=MODEL, messages=msgs, max_tokens=12, temperature=0, tools=[WEATHER])
    whole = client.chat.completions.create(**kw).choices[0].message.content
    parts = [c.choices[0].delta.content for c in client.chat.completions.create(stream=True, **kw)
             if c.choices and c.choices[0].delta.content]
    assert len(parts) > 1 and "".join(parts) == whole
    # Forced into an unterminated call (<tool_call> is id 8184): no tool_calls, no text (the tags are special).
    for stream in (False, True):
        kw = dict(model=MODEL, messages=msgs, max_tokens=2, temperature=0, tools=[WEATHER], logit_bias={"8184": 100})
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kw))
            assert not any(c.choices and c.choices[0].delta.tool_calls for c in chunks)
            assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
        else:
            cut = client.chat.completions.create(**kw)
            assert cut.choices[0].message.tool_calls is None and cut.choices[0].finish_reason == "length"
    for tools, param in [([{"type": "retrieval"}], "tools[0].type"), ([{"type": "function", "function": {}}],
                                                                       "tools[0].function.name"),
                         ("get_weather", "tools")]:
        status, err = error_of(demo.http("POST", "/v1/chat/completions", {"model": MODEL, "messages": msgs, "tools": tools}))
        assert status == 400 and err["param"] == param, err
    status, err = error_of(demo.http("POST", "/v1/chat/completions", {"model": MODEL, "messages": msgs, "tools": [WEATHER],
                                                                      "parallel_tool_calls": "no"}))
    assert status == 400 and err["param"] == "parallel_tool_calls", err
    bad_turn = [msgs[0], {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]
    status, err = error_of(demo.http("POST", "/v1/chat/completions", {"model": MODEL, "messages": bad_turn}))
    assert status == 400 and err["param"] == "messages[1].tool_calls[0].function.arguments", err
    still_serving(demo)


def write_scripted_model(dst, successor, first, eos):
    """A one-layer GLM-DSA model (the demo's shapes and tokenizer) that writes a fixed script: its
    attention and MLP outputs are zero, so a position's hidden state is its token's embedding, a
    one-hot of the token's state (0 for every token outside the script); lm_head maps state s to
    the successor of the token that owns it, state 0 to the script's first token."""
    import struct
    src = DEMO
    with open(src / "model.safetensors", "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    names = [k for k in header if k != "__metadata__" and (".layers." not in k or k.startswith("model.layers.0."))]
    tokens = list(successor)
    state = {t: i + 1 for i, t in enumerate(tokens)}
    hidden = header["model.embed_tokens.weight"]["shape"][1]
    assert len(tokens) < hidden
    out_header, blobs, offset = {}, [], 0
    for name in sorted(names):
        shape = header[name]["shape"]
        count = 1
        for d in shape:
            count *= d
        data = bytearray(4 * count)
        if name.endswith("norm.weight"):
            struct.pack_into(f"<{count}f", data, 0, *([1.0] * count))
        elif name == "model.embed_tokens.weight":
            for t in range(shape[0]):
                struct.pack_into("<f", data, 4 * (t * hidden + state.get(t, 0)), 1.0)
        elif name == "lm_head.weight":
            struct.pack_into("<f", data, 4 * (first * hidden), 1.0)
            for t, nxt in successor.items():
                struct.pack_into("<f", data, 4 * (nxt * hidden + state[t]), 1.0)
        out_header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    head = json.dumps(out_header).encode()
    head += b" " * (-len(head) % 8)
    dst.mkdir(parents=True, exist_ok=True)
    with open(dst / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for b in blobs:
            f.write(b)
    config = json.loads((src / "config.json").read_text())
    config.update(num_hidden_layers=1, indexer_types=["full"], mlp_layer_types=["dense"], num_nextn_predict_layers=0,
                  dtype="float32", eos_token_id=eos)
    (dst / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (dst / name).write_bytes((src / name).read_bytes())


def test_streamed_tool_call_deltas_end_to_end(demo, tmp_path):
    """A scripted model writes some text and a GLM-5 tool call: the stream carries the text, then the
    call's id and name, then its arguments in pieces (the string value among them) that add up to
    the reply read whole; finish reason tool_calls, streamed or not."""
    text = "Sure.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>"
    tok = lambda s: json.loads(demo.http("POST", "/tokenize", {"model": MODEL, "prompt": s,
                                                                 "add_special_tokens": False})[1])["tokens"]
    script = tok(text)
    assert len(set(script)) == len(script), script  # a token's successor is its own
    eos = 8172
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    prompt = json.loads(demo.http("POST", "/tokenize", {"model": MODEL, "messages": msgs, "tools": [WEATHER]})[1])
    assert prompt["tokens"][-1] not in script
    write_scripted_model(tmp_path / "scripted", dict(zip(script, script[1:] + [eos])), script[0], eos)
    s = Server(tmp_path / "scripted", "--max-batch", "2")
    try:
        client = s.client()
        kw = dict(model="scripted", messages=msgs, tools=[WEATHER], max_tokens=64, temperature=0)
        whole = client.chat.completions.create(**kw)
        ch = whole.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.content == "Sure."
        (call,) = ch.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
        chunks = list(client.chat.completions.create(stream=True, **kw))
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
        assert content == "Sure."
        assert deltas[0].id and deltas[0].function.name == "get_weather" and deltas[0].type == "function"
        assert all(d.index == 0 for d in deltas) and all(d.id is None for d in deltas[1:])
        args = [d.function.arguments for d in deltas if d.function and d.function.arguments]
        # The string value streams token by token as written: no piece holds it whole.
        value_tokens = script.index(tok("</arg_value>")[0]) - script.index(tok("<arg_value>")[0]) - 1
        assert value_tokens >= 2 and len(args) >= value_tokens + 2, args
        assert not any("Paris" in a for a in args), args
        assert "".join(args) == call.function.arguments
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    finally:
        s.stop()


def test_skip_special_tokens_false_end_to_end(demo, tmp_path):
    """skip_special_tokens false (vLLM's): a scripted model writes reasoning, </think>, then content
    with a special token in it. /v1/completions returns every token's text, <sop> and </think>
    included; chat under --reasoning-parser glm45 keeps the </think> that ends the
    reasoning out of both parts (as vLLM's parser) and writes the content's special tokens, streamed
    or not; the default skips them. The EOS that ends the reply is not written either way. Stop
    strings match across </think>, as vLLM's (on the whole text)."""
    text = "Hmm.</think>Yes<sop>ok"
    tok = lambda s: json.loads(demo.http("POST", "/tokenize", {"model": MODEL, "prompt": s,
                                                                 "add_special_tokens": False})[1])["tokens"]
    script = tok(text)
    assert len(set(script)) == len(script) and 8183 in script, script  # </think> as its special token
    eos = 8172
    msgs = [{"role": "user", "content": "Well?"}]
    write_scripted_model(tmp_path / "scripted", dict(zip(script, script[1:] + [eos])), script[0], eos)
    s = Server(tmp_path / "scripted", "--max-batch", "2", "--reasoning-parser", "glm45")
    try:
        client = s.client()
        raw = {"skip_special_tokens": False}
        comp = dict(model="scripted", prompt="Q", max_tokens=32, temperature=0)
        assert client.completions.create(**comp, extra_body=raw).choices[0].text == text
        assert client.completions.create(**comp).choices[0].text == "Hmm.Yesok"
        streamed = client.completions.create(**comp, extra_body=raw, stream=True)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == text
        kw = dict(model="scripted", messages=msgs, max_tokens=32, temperature=0)
        m = client.chat.completions.create(**kw, extra_body=raw).choices[0].message
        assert m.model_extra["reasoning_content"] == "Hmm." and m.content == "Yes<sop>ok"
        m = client.chat.completions.create(**kw).choices[0].message
        assert m.model_extra["reasoning_content"] == "Hmm." and m.content == "Yesok"
        deltas = [c.choices[0].delta for c in client.chat.completions.create(**kw, extra_body=raw, stream=True)
                  if c.choices]
        assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == "Hmm."
        assert "".join(d.content or "" for d in deltas) == "Yes<sop>ok"
        status, err = error_of(s.http("POST", "/v1/completions", dict(comp, skip_special_tokens="no")))
        assert status == 400 and err["param"] == "skip_special_tokens", err
        # A stop string spanning </think> stops there (vLLM matches stops on the whole text, before
        # its reasoning parser splits it): the reasoning is cut before it, and there is no content.
        for extra in ({}, raw):
            r = client.chat.completions.create(**kw, stop=["m.Ye"], extra_body=extra)
            m = r.choices[0].message
            assert r.choices[0].finish_reason == "stop" and m.model_extra["reasoning_content"] == "Hm", m
            assert not m.content, m
            chunks = list(client.chat.completions.create(**kw, stop=["m.Ye"], stream=True, extra_body=extra))
            deltas = [c.choices[0].delta for c in chunks if c.choices]
            assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == "Hm"
            assert not "".join(d.content or "" for d in deltas)
        # A stop string's start withheld at </think> that turns out not to be one comes out as
        # reasoning, before the content.
        r = client.chat.completions.create(**kw, stop=["m.Yes!"])
        m = r.choices[0].message
        assert m.model_extra["reasoning_content"] == "Hmm." and m.content == "Yesok", m
        deltas = [c.choices[0].delta for c in client.chat.completions.create(**kw, stop=["m.Yes!"], stream=True)
                  if c.choices]
        assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == "Hmm."
        assert "".join(d.content or "" for d in deltas) == "Yesok"
    finally:
        s.stop()


def test_logprobs(demo):
    c = demo_cases()[1]
    client = demo.client()
    r = client.completions.create(model=MODEL, prompt=c["prompt_ids"], max_tokens=6, logprobs=3, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert val <= 0 and len(top) == 3
        assert max(top.values()) == pytest.approx(val)  # greedy picks the most likely token
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == pytest.approx(e.logprob)
        assert e.bytes == list(e.token.encode())
    stream = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=5, temperature=0, logprobs=True, top_logprobs=2,
                                                 stream=True))
    streamed = [e.token for ch in stream if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert streamed == [e.token for e in content]


def error_of(status_body):
    status, body = status_body
    return status, json.loads(body)["error"]


@pytest.mark.parametrize("body,param,needle", [
    ({"prompt": "x", "max_tokens": "ten"}, "max_tokens", "must be an integer"),
    ({"prompt": "x", "temperature": "hot"}, "temperature", "must be a number"),
    ({"prompt": "x", "temperature": 3}, "temperature", "[0, 2]"),
    ({"prompt": "x", "stream": "yes"}, "stream", "boolean"),
    ({"prompt": "x", "stop": 5}, "stop", "string or a list"),
    ({"prompt": {"a": 1}}, "prompt", "string or a list"),
    ({"prompt": [1, "a"]}, "prompt", "token id"),
    ({"prompt": [999999]}, "prompt", "out of range"),
    ({}, "prompt", "required"),
    ({"prompt": "x", "n": 17}, "n", "[1, 16]"),
    ({"prompt": "x", "logprobs": 21}, "logprobs", "[0, 20]"),
    ({"prompt": "x", "max_tokens": 5000}, "max_tokens", "context"),
    ({"prompt": "x", "max_tokens": 2**63 - 1}, "max_tokens", "context"),  # (prompt + it overflowed once)
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", "[1,"),
    ({"prompt": list(range(2048))}, "prompt", "context"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "stream is true"),
    ({"prompt": "x", "frequency_penalty": 2.5}, "frequency_penalty", "[-2, 2]"),
    ({"prompt": "x", "presence_penalty": "some"}, "presence_penalty", "must be a number"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty", "(0, 100]"),
    ({"prompt": "x", "response_format": {"type": "json_object"}}, "response_format", "no constrained decoding"),
    ({"prompt": "x", "guided_regex": "a+"}, "guided_regex", "constrained decoding"),
    ({"prompt": "x", "tool_choice": "required"}, "tool_choice", "constrained decoding"),
    ({"prompt": "x", "min_tokens": 4, "max_tokens": 2}, "min_tokens", "more than max_tokens"),
    ({"prompt": "x", "use_beam_search": True}, "use_beam_search", "beam search"),
    ({"prompt": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "at least 1"),
    ({"prompt": "x", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens", "[-1,"),
    ({"prompt": "x", "truncate_prompt_tokens": 100000}, "truncate_prompt_tokens", "context of"),
    ({"prompt": "x", "prompt_logprobs": 1}, "prompt_logprobs", "echo with logprobs"),
    ({"prompt": "x", "bad_words": "x"}, "bad_words", "list of strings"),
    ({"prompt": "x", "bad_words": ["x", 3]}, "bad_words", "must be a string"),
    ({"prompt": "x", "bad_words": ["  "]}, "bad_words", "no tokens"),
    ({"prompt": "x", "return_tokens_as_token_ids": True}, "return_tokens_as_token_ids", "only false"),
    ({"prompt": "x", "priority": 1}, "priority", "only 0"),
    ({"prompt": "x", "logits_processors": ["m.f"]}, "logits_processors", "not supported"),
    ({"prompt": "x", "chat_template": "{{ 1 }}"}, "chat_template", "--chat-template"),
    ({"prompt": "x", "modalities": ["text", "audio"]}, "modalities", "only"),
    ({"prompt": "x", "include_stop_str_in_output": "yes"}, "include_stop_str_in_output", "boolean"),
])
def test_completions_rejects_bad_fields(demo, body, param, needle):
    status, err = error_of(demo.http("POST", "/v1/completions", {"model": MODEL, **body}))
    assert status == 400, err
    assert err["param"] == param and needle in err["message"] and err["type"] == "invalid_request_error"


@pytest.mark.parametrize("messages,param,needle", [
    ([{"role": "wizard", "content": "x"}], "messages[0].role", "unknown role"),
    ([{"role": "user", "content": 5}], "messages[0].content", "string or a list"),
    ([{"content": "x"}], "messages[0].role", "required"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages[0].content[0].type",
     "only text"),
    ("hello", "messages", "list of messages"),
    ([], "messages", "at least one"),
    ([{"role": "user", "content": "word " * 3000}], "messages", "context"),
])
def test_chat_rejects_bad_messages(demo, messages, param, needle):
    status, err = error_of(demo.http("POST", "/v1/chat/completions", {"model": MODEL, "messages": messages}))
    assert status == 400, err
    assert err["param"] == param and needle in err["message"]


def test_malformed_requests_and_limits(demo):
    status, err = error_of(demo.http("POST", "/v1/completions", raw=b'{"prompt": "x", '))
    assert status == 400 and "not valid JSON" in err["message"]
    status, err = error_of(demo.http("POST", "/v1/completions", raw=b'[1, 2]'))
    assert status == 400 and "JSON object" in err["message"]
    status, err = error_of(demo.http("POST", "/v1/completions", raw=json.dumps({"prompt": "x" * 70000}).encode()))
    assert status == 413 and "65536" in err["message"]
    status, err = error_of(demo.http("POST", "/v1/completions", {"model": "gpt-4", "prompt": "x"}))
    assert status == 404 and err["code"] == "model_not_found"
    status, err = error_of(demo.http("GET", "/v1/nothing"))
    assert status == 404
    with pytest.raises(openai.BadRequestError) as e:
        demo.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=-1)
    assert e.value.body["param"] == "max_tokens"
    still_serving(demo)
    m = demo.metrics()
    assert m['vireo_requests_total{status="400"}'] >= 3 and m['vireo_requests_total{status="413"}'] >= 1


def test_token_id_model_without_tokenizer(fixture_server):
    s = fixture_server
    import json as _j
    from conftest import FIXTURES
    e = _j.loads((FIXTURES / "glm_dsa_shared_f32" / "expected.json").read_text())
    client = s.client()
    model = client.models.list().data[0].id
    assert model == "glm_dsa_shared_f32"
    r = client.completions.create(model=model, prompt=e["greedy_prompt"], max_tokens=len(e["greedy_new"]), **GREEDY)
    assert r.choices[0].model_extra["token_ids"] == e["greedy_new"]
    assert r.usage.completion_tokens == len(e["greedy_new"])
    chunks = list(client.completions.create(model=model, prompt=e["greedy_prompt"], max_tokens=len(e["greedy_new"]),
                                            stream=True, **GREEDY))
    assert [t for ch in chunks for t in ch.choices[0].model_extra.get("token_ids", [])] == e["greedy_new"]
    status, err = error_of(s.http("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}))
    assert status == 400 and "no usable chat template" in err["message"] and "/v1/completions" in err["message"]
    status, err = error_of(s.http("POST", "/v1/completions", {"prompt": "text"}))
    assert status == 400 and "no tokenizer" in err["message"]
    status, err = error_of(s.http("POST", "/v1/completions", {"prompt": [1, 2], "max_tokens": 127}))
    assert status == 400 and err["param"] == "max_tokens"


def test_prefix_reuse_gives_the_same_logprobs(fixture_server):
    """serve reuses a finished request's whole prompt chunks (--prefill-chunk 8 here) for a request
    whose prompt starts the same: the metrics count the reused tokens, and the tokens and logprobs
    are the first request's, to the bit (the CPU)."""
    from conftest import FIXTURES
    e = json.loads((FIXTURES / "glm_dsa_shared_f32" / "expected.json").read_text())
    s = fixture_server
    client = s.client()
    model = client.models.list().data[0].id
    prompt = e["tokens"][:30]
    kw = dict(model=model, prompt=prompt, max_tokens=6, logprobs=2, **GREEDY)
    first = client.completions.create(**kw)
    before = s.metrics()["vireo_prefix_tokens_reused_total"]
    again = client.completions.create(**kw)
    assert s.metrics()["vireo_prefix_tokens_reused_total"] - before == 24  # whole chunks of the 29 before the last
    assert again.choices[0].model_extra["token_ids"] == first.choices[0].model_extra["token_ids"]
    assert again.choices[0].logprobs.token_logprobs == first.choices[0].logprobs.token_logprobs
    assert again.choices[0].logprobs.top_logprobs == first.choices[0].logprobs.top_logprobs


def test_client_disconnect_cancels_non_streaming_request(demo):
    import socket
    import time
    before = demo.metrics().get('vireo_requests_finished_total{reason="cancelled"}', 0)
    body = json.dumps({"model": MODEL, "prompt": [440, 435, 1131], "max_tokens": 2000, "temperature": 0,
                       "ignore_eos": True}).encode()
    sock = socket.create_connection(("127.0.0.1", demo.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: " + str(len(body)).encode() +
                 b"\r\n\r\n" + body)
    deadline = time.time() + 30
    while demo.metrics()["vireo_running_batch_size"] == 0:  # admitted and decoding
        assert time.time() < deadline
        time.sleep(0.01)
    sock.close()  # gone long before 2000 tokens
    while True:
        m = demo.metrics()
        if m.get('vireo_requests_finished_total{reason="cancelled"}', 0) > before and m["vireo_cache_bytes_in_use"] == 0:
            break
        assert time.time() < deadline, m
        time.sleep(0.02)
    still_serving(demo)


def test_mtp_serving_keeps_greedy_tokens_and_counts_drafts(demo_mtp):
    """serve --mtp: concurrent greedy requests get transformers' continuations; seeded sampling is
    reproducible; /metrics counts the drafts kept and rejected."""
    from concurrent.futures import ThreadPoolExecutor

    client = demo_mtp.client()

    def greedy(c):
        r = client.completions.create(model=MODEL, prompt=c["prompt_ids"], max_tokens=48, **GREEDY)
        return r.choices[0].model_extra["token_ids"]

    cases = demo_cases()
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(greedy, cases))
    for c, ids in zip(cases, got):
        assert ids == c["continuation_ids"]
    kw = dict(model=MODEL, prompt="The Unicode standard", max_tokens=24, temperature=0.9, top_p=0.9, seed=7,
              extra_body={"ignore_eos": True})
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text
    # Penalties need the host's pick a step, which drafting does not make: refused by name.
    status, err = error_of(demo_mtp.http("POST", "/v1/completions",
                                         {"model": MODEL, "prompt": "x", "frequency_penalty": 0.5}))
    assert status == 400 and err["param"] == "frequency_penalty" and "speculative" in err["message"], err
    m = demo_mtp.metrics()
    kept, rejected = m['vireo_mtp_drafts_total{outcome="kept"}'], m['vireo_mtp_drafts_total{outcome="rejected"}']
    assert kept > 0 and rejected > 0
    # Each kept draft is a second token from one step.
    assert m["vireo_generation_tokens_total"] >= kept


def test_mtp_serving_scores_echoed_prompts_as_the_plain_server(demo, demo_mtp):
    """serve --mtp: echo with logprobs (lm-eval's loglikelihood requests) gives the plain server's
    prompt logprobs and tokens, with max_tokens 0 and with tokens asked for."""
    ids = demo_cases()[4]["prompt_ids"]
    for max_tokens in (0, 6):
        kw = dict(model=MODEL, prompt=ids, max_tokens=max_tokens, echo=True, logprobs=2, temperature=0)
        want, got = demo.client().completions.create(**kw), demo_mtp.client().completions.create(**kw)
        assert got.choices[0].text == want.choices[0].text
        wl, gl = want.choices[0].logprobs, got.choices[0].logprobs
        assert gl.tokens == wl.tokens and len(gl.tokens) == len(ids) + max_tokens
        assert gl.token_logprobs[0] is None
        for g, w in zip(gl.token_logprobs[1:], wl.token_logprobs[1:]):
            assert abs(g - w) < 1e-4, (g, w)


def test_reasoning_parser_splits_chat_replies(demo, demo_reasoning):
    """--reasoning-parser glm45: the demo's chat template ends its generation prompt with <think>,
    so a reply is reasoning until </think>; the demo model does not write one within 16 tokens, so
    the plain server's content comes back whole as reasoning_content (streamed as
    delta.reasoning_content) with the same tokens. enable_thinking false makes it content again,
    include_reasoning false leaves it out, a forced </think> (id 8183) ends the reasoning at once,
    and /v1/completions is never split. (tests/test_text_output.cpp splits mid-reply.)"""
    msgs = [{"role": "user", "content": "What is Unicode?"}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=16, temperature=0)
    ids = {"return_token_ids": True}
    plain = demo.client().chat.completions.create(**kw, extra_body=ids)
    text = plain.choices[0].message.content
    assert text and "reasoning_content" not in plain.choices[0].message.model_extra
    client = demo_reasoning.client()
    r = client.chat.completions.create(**kw, extra_body=ids)
    m = r.choices[0].message
    assert m.model_extra["reasoning_content"] == text and m.content == ""
    assert r.choices[0].model_extra["token_ids"] == plain.choices[0].model_extra["token_ids"]
    assert r.usage.completion_tokens_details.reasoning_tokens == r.usage.completion_tokens == 16
    assert plain.usage.completion_tokens_details is None
    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == text
    assert not any(d.content for d in deltas)
    # Tools do not hold the reasoning back: it streams as it comes, and no call is read from it.
    tool_chunks = list(client.chat.completions.create(**kw, stream=True, tools=[WEATHER]))
    assert sum(1 for c in tool_chunks if c.choices and c.choices[0].delta.model_extra.get("reasoning_content")) > 1
    # Thinking off: the prompt ends with </think>, and the reply is content.
    off = dict(kw, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    want = demo.client().chat.completions.create(**off).choices[0].message.content
    got = client.chat.completions.create(**off).choices[0].message
    assert got.content == want and want and got.model_extra["reasoning_content"] is None
    assert client.chat.completions.create(**off).usage.completion_tokens_details.reasoning_tokens == 0
    hidden = client.chat.completions.create(**kw, extra_body={"include_reasoning": False}).choices[0].message
    assert hidden.content == "" and "reasoning_content" not in hidden.model_extra
    hidden_chunks = list(client.chat.completions.create(**kw, stream=True, extra_body={"include_reasoning": False}))
    assert not any(c.choices and (c.choices[0].delta.content or c.choices[0].delta.model_extra.get("reasoning_content"))
                   for c in hidden_chunks)
    forced = client.chat.completions.create(**dict(kw, max_tokens=3), logit_bias={"8183": 100}, extra_body=ids)
    assert forced.choices[0].model_extra["token_ids"] == [8183] * 3
    assert forced.usage.completion_tokens_details.reasoning_tokens == 1  # the </think> itself
    assert forced.choices[0].message.model_extra["reasoning_content"] is None and forced.choices[0].message.content == ""
    comp = client.completions.create(model=MODEL, prompt=r.model_extra["prompt_token_ids"], max_tokens=16, temperature=0)
    assert comp.choices[0].text == text
    status, err = error_of(demo_reasoning.http("POST", "/v1/chat/completions", dict(kw, include_reasoning="no")))
    assert status == 400 and err["param"] == "include_reasoning", err


def test_chat_knobs(demo):
    """add_generation_prompt false renders the conversation without the assistant's opening (the
    prompt /tokenize counts); chat echo and audio are refused by name, and continue_final_message
    with the generation prompt on."""
    msgs = [{"role": "user", "content": "What is Unicode?"}]
    bare = json.loads(demo.http("POST", "/tokenize", {"messages": msgs, "add_generation_prompt": False})[1])["tokens"]
    r = demo.client().chat.completions.create(model=MODEL, messages=msgs, max_tokens=1,
                                              extra_body={"add_generation_prompt": False, "return_token_ids": True})
    assert r.model_extra["prompt_token_ids"] == bare
    for extra, param in [({"echo": True}, "echo"), ({"continue_final_message": True}, "continue_final_message"),
                         ({"audio": {"voice": "x"}}, "audio"), ({"prompt_logprobs": 1}, "prompt_logprobs")]:
        status, err = error_of(demo.http("POST", "/v1/chat/completions", {"model": MODEL, "messages": msgs, **extra}))
        assert status == 400 and err["param"] == param, err


def test_tokenize_and_detokenize(demo):
    """vLLM's /tokenize and /detokenize: a prompt's ids as /v1/completions reads it, chat messages'
    as /v1/chat/completions renders them (with or without the generation prompt), the text back
    with special tokens spelled; bad bodies refused by field; the API key guards them."""
    c = demo_cases()[0]
    status, body = demo.http("POST", "/tokenize", {"model": MODEL, "prompt": c["prompt"], "return_token_strs": True})
    t = json.loads(body)
    assert status == 200 and t["tokens"] == c["prompt_ids"] and t["count"] == len(c["prompt_ids"])
    assert t["max_model_len"] > 0 and "".join(t["token_strs"]) == c["prompt"]
    msgs = [{"role": "user", "content": "What is Unicode?"}]
    chat = demo.client().chat.completions.create(model=MODEL, messages=msgs, max_tokens=1,
                                                 extra_body={"return_token_ids": True})
    t = json.loads(demo.http("POST", "/tokenize", {"model": MODEL, "messages": msgs})[1])
    assert t["tokens"] == chat.model_extra["prompt_token_ids"] and t["token_strs"] is None
    bare = json.loads(demo.http("POST", "/tokenize", {"messages": msgs, "add_generation_prompt": False})[1])["tokens"]
    assert len(bare) < len(t["tokens"]) and t["tokens"][:len(bare)] == bare
    status, body = demo.http("POST", "/detokenize", {"model": MODEL, "tokens": t["tokens"]})
    text = json.loads(body)["prompt"]
    assert status == 200 and "<|user|>" in text and "What is Unicode?" in text
    for path, req, param in [("/tokenize", {"prompt": 5}, "prompt"), ("/tokenize", {}, "prompt"),
                             ("/tokenize", {"prompt": "x", "messages": msgs}, "prompt"),
                             ("/tokenize", {"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role"),
                             ("/detokenize", {"tokens": [1, 99999]}, "tokens"), ("/detokenize", {}, "tokens")]:
        status, err = error_of(demo.http("POST", path, req))
        assert status == 400 and err["param"] == param, (path, req, err)
    status, err = error_of(demo.http("POST", "/tokenize", {"model": "other", "prompt": "x"}))
    assert status == 404 and err["code"] == "model_not_found"
    assert demo.http("POST", "/tokenize", {"prompt": "x"}, auth=False)[0] == 401


def test_continue_final_message(tmp_path):
    """continue_final_message (add_generation_prompt false) cuts the rendered conversation right
    after the final message's text, as transformers does (its trailing space kept where the
    template keeps it, the end-of-turn mark after it gone), so the reply continues that message:
    its tokens are what /v1/completions generates from that prompt; a final message with no text
    to continue is refused by field. (The demo's own template ends an assistant turn with its
    text, so a template that closes turns shows the cut.)"""
    (tmp_path / "t.jinja").write_text("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|endoftext|>{% endfor %}"
                                      "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    s = demo_server("--max-batch", "2", "--chat-template", str(tmp_path / "t.jinja"))
    try:
        msgs = [{"role": "user", "content": "What is Unicode?"}, {"role": "assistant", "content": "Unicode is a "}]
        kw = {"messages": msgs, "add_generation_prompt": False}
        closed = json.loads(s.http("POST", "/tokenize", kw)[1])["tokens"]
        cont = json.loads(s.http("POST", "/tokenize", dict(kw, continue_final_message=True))[1])["tokens"]
        want = json.loads(s.http("POST", "/tokenize", {"prompt": "<|user|>What is Unicode?<|endoftext|>"
                                                                "<|assistant|>Unicode is a ", "add_special_tokens": False})[1])
        assert cont == want["tokens"] and closed[:len(cont)] == cont and len(closed) > len(cont)
        client = s.client()
        r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0,
                                           extra_body={"add_generation_prompt": False, "continue_final_message": True,
                                                       "return_token_ids": True})
        assert r.model_extra["prompt_token_ids"] == cont
        comp = client.completions.create(model=MODEL, prompt=cont, max_tokens=8, temperature=0,
                                         extra_body={"return_token_ids": True})
        assert r.choices[0].message.content == comp.choices[0].text
        assert r.choices[0].model_extra["token_ids"] == comp.choices[0].model_extra["token_ids"]
        status, err = error_of(s.http("POST", "/v1/chat/completions", {
            "model": MODEL, "add_generation_prompt": False, "continue_final_message": True,
            "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " \n "}]}))
        assert status == 400 and err["param"] == "messages[1].content", err
    finally:
        s.stop()


def test_chat_template_override(tmp_path):
    """serve --chat-template FILE renders chat with that template (the special tokens still from
    tokenizer_config.json): /tokenize's ids are the template's text's."""
    (tmp_path / "t.jinja").write_text("{{ eos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}")
    s = demo_server("--max-batch", "2", "--chat-template", str(tmp_path / "t.jinja"))
    try:
        got = json.loads(s.http("POST", "/tokenize", {"messages": [{"role": "user", "content": "Hi there"}]})[1])
        want = json.loads(s.http("POST", "/tokenize", {"prompt": "<|endoftext|>[user] Hi there",
                                                      "add_special_tokens": False})[1])
        assert got["tokens"] == want["tokens"] and got["count"] > 3
    finally:
        s.stop()


def test_throughput_lines_after_work():
    """--log-interval: a stderr line of prompt and generation rates and the gauges after an interval
    with work, none while idle. (The server takes vLLM's --max-num-seqs and --max-model-len.)"""
    import re
    import time
    s = demo_server("--max-num-seqs", "2", "--max-model-len", "300", "--log-interval", "0.5")  # (vLLM's names)
    try:
        assert json.loads(s.http("GET", "/v1/models")[1])["data"][0]["max_model_len"] == 300
        time.sleep(1.2)
        assert not any("tok/s" in line for line in s.log), s.log
        r = s.client().completions.create(model=MODEL, prompt=[440, 435, 1131], max_tokens=8, temperature=0)
        assert r.usage.completion_tokens == 8
        deadline = time.time() + 20  # the next interval's line (polled: a loaded machine is slow)
        while not (lines := [line for line in s.log if "generation" in line]) and time.time() < deadline:
            time.sleep(0.1)
        assert lines, s.log
        m = re.search(r"prompt ([\d.]+) tok/s, generation ([\d.]+) tok/s, running (\d+), waiting (\d+), "
                      r"cache ([\d.]+)% of ([\d.]+) MiB in use", lines[0])
        assert m and float(m.group(2)) > 0 and float(m.group(1)) > 0, lines[0]
    finally:
        s.stop()
