"""runtime/context_shift.drop_oldest: the one dropping policy of `chat` and `serve --context-shift`,
over a stand-in template (one id per message) so each case's count is plain."""

from __future__ import annotations

from tierlm.runtime.context_shift import drop_oldest


def render(messages):
    return [len(m["content"]) for m in messages]  # one id per message


def fits_in(n: int):
    return lambda ids: len(ids) <= n


def msg(role: str, content: str) -> dict:
    return {"role": role, "content": content}


def test_the_oldest_exchanges_go_whole_and_the_leading_system_messages_stay():
    messages = [msg("system", "s1"), msg("system", "s2"), msg("user", "u1"), msg("assistant", "a1"),
                msg("user", "u2"), msg("assistant", "a2"), msg("user", "u3")]
    kept, ids = drop_oldest(messages, render, fits_in(5))
    assert [m["content"] for m in kept] == ["s1", "s2", "u2", "a2", "u3"]
    assert ids == render(kept)
    kept, _ = drop_oldest(messages, render, fits_in(4))
    assert [m["content"] for m in kept] == ["s1", "s2", "u3"]


def test_what_fits_is_left_alone_and_a_last_message_that_does_not_is_returned_for_refusal():
    messages = [msg("user", "u1"), msg("assistant", "a1"), msg("user", "u2")]
    assert drop_oldest(messages, render, fits_in(3))[0] == messages
    kept, ids = drop_oldest(messages, render, lambda ids: False)
    assert kept == [messages[-1]] and ids == render(kept)


def test_a_user_message_without_a_reply_after_it_goes_alone():
    messages = [msg("system", "s"), msg("user", "u1"), msg("user", "u2"), msg("assistant", "a2"), msg("user", "u3")]
    kept, _ = drop_oldest(messages, render, fits_in(4))
    assert [m["content"] for m in kept] == ["s", "u2", "a2", "u3"]


def linear(messages, fits):
    """The policy as chat first wrote it, one exchange at a time: the reference."""
    head = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    system, rest = messages[:head], messages[head:]
    while True:
        ids = render(system + rest)
        if fits(ids) or len(rest) <= 1:
            return system + rest, ids
        rest = rest[2 if len(rest) > 2 and rest[1]["role"] == "assistant" else 1:]


def test_it_keeps_what_dropping_one_exchange_at_a_time_keeps_with_few_renderings():
    roles = ["user", "assistant", "user", "user", "assistant", "assistant", "user", "assistant", "user"]
    shapes = [[msg("system", "s")], []]
    for system in shapes:
        for length in range(0, len(roles) + 1):
            messages = system + [msg(role, f"{role[0]}{n}") for n, role in enumerate(roles[:length])]
            for room in range(0, len(messages) + 2):
                assert drop_oldest(messages, render, fits_in(room)) == linear(messages, fits_in(room)), (length, room)
    renderings = []
    long = [msg("system", "s")] + [msg(role, "x") for _ in range(256) for role in ("user", "assistant")]
    long.append(msg("user", "last"))
    kept, _ = drop_oldest(long, lambda m: renderings.append(len(m)) or render(m), fits_in(11))
    assert kept == [long[0], *long[-9:]] and len(renderings) <= 10  # whole exchanges; ~log2(257) + the whole
