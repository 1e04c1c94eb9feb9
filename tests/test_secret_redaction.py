"""The scrubber removes a token in every spelling it can take (issue 12 row 1).

A token read from a secret file or a ``secretKeyRef`` can end in ``\\n``/``\\r\\n``/``\\t``;
messages then carry it raw, stripped, ``repr``-escaped, JSON-escaped or inside header bytes
(``Illegal header value b'Bearer hf_...\\n'``). Every consumer of the scrubber is checked: the
transports' retry policy, the MetricLogger (text and JSONL), the CLI's error line.
"""

from __future__ import annotations

import base64
import io
import json
from urllib.parse import quote

import pytest

from speedtronic.diloco.exchange import scrub as transport_scrub
from speedtronic.metrics.logger import MetricLogger
from speedtronic.retry import RetryPolicy, TransportError

CORE = "hf_RedactMe0123456789abcdefghijklmnop"
REDACTED = "<redacted>"
PADS = ["\n", "\r\n", "\t", " \n", "\n\n"]


def spellings(token: str) -> list[str]:
    """How a message can spell ``token`` (and its whitespace-stripped core)."""
    core = token.strip()
    header = f"Bearer {token}".encode()
    return [
        token,
        core,
        repr(token),
        json.dumps(token),
        json.dumps(repr(token)),  # a repr'd message inside a JSON log line
        repr(repr(token)),
        f"Illegal header value {header!r}",
        json.dumps(f"Illegal header value {header!r}"),
        quote(core, safe=""),
        base64.b64encode(core.encode()).decode(),
        base64.urlsafe_b64encode(core.encode()).decode().rstrip("="),
    ]


def leaks(text: str, token: str) -> list[str]:
    core = token.strip()
    encoded = [
        core,
        base64.b64encode(core.encode()).decode().rstrip("="),
        quote(core, safe=""),
    ]
    return [form for form in encoded if form in text]


@pytest.mark.parametrize("pad", PADS)
def test_every_spelling_is_scrubbed(pad) -> None:
    from speedtronic.config.redaction import scrub

    token = CORE + pad
    for text in spellings(token):
        cleaned = scrub(f"before {text} after", [token])
        assert not leaks(cleaned, token), (text, cleaned)
        assert REDACTED in cleaned


def test_forms_are_longest_first_and_never_tiny() -> None:
    from speedtronic.config.redaction import scrub, secret_forms

    forms = secret_forms(CORE + "\r\n")
    assert list(forms) == sorted(forms, key=lambda f: (-len(f), f))
    assert all(len(form) >= 4 for form in forms)
    assert scrub("abc and ab", ["ab"]) == "abc and ab"  # secrets under 4 characters are ignored


def test_token_shaped_strings_are_scrubbed_without_being_told() -> None:
    from speedtronic.config.redaction import scrub

    assert scrub(f"echo {CORE}", []) == f"echo {REDACTED}"
    assert scrub("hf_short and hf_cache_dir", []) == "hf_short and hf_cache_dir"


@pytest.mark.parametrize("pad", PADS)
def test_transport_errors_never_carry_the_token(pad) -> None:
    token = CORE + pad
    header = f"Bearer {token}".encode()

    def fail() -> None:
        raise ValueError(f"Illegal header value {header!r} ({token!r})")

    policy = RetryPolicy(attempts=1, secrets=(token,), sleeper=lambda s: None)
    with pytest.raises(TransportError) as info:
        policy.run("download global/step_count.json", fail)
    assert not leaks(str(info.value), token)
    assert not leaks(transport_scrub(repr(header), [token]), token)


@pytest.mark.parametrize("pad", PADS)
def test_metric_logger_redacts_every_spelling_in_text_and_jsonl(tmp_path, pad) -> None:
    token = CORE + pad
    stream = io.StringIO()
    events = tmp_path / "events.jsonl"
    logger = MetricLogger(stream=stream, json_file=events, secrets=[token])
    header = f"Bearer {token}".encode()
    logger.warning("upload failed: Illegal header value %r", header)
    logger.warning("token was %r", token)
    logger.emit("hub_error", {"error": f"Illegal header value {header!r}", "raw": token})
    logger.close()
    for text in (stream.getvalue(), events.read_text()):
        assert not leaks(text, token), text
    json_logger = MetricLogger(stream=(out := io.StringIO()), format="json", secrets=[token])
    json_logger.emit("hub_error", {"error": repr(header)})
    json_logger.warning("%s", repr(token))
    json_logger.close()
    assert not leaks(out.getvalue(), token)
    for line in out.getvalue().splitlines():
        json.loads(line)  # still one JSON object per line


def test_the_run_s_log_handler_scrubs_the_token_from_every_module_s_lines(capsys):
    """The entrypoint's stdout handler scrubs the token whichever logger wrote the line: a
    child logger (``speedtronic.slots``), a line before a component started or after
    it stopped (issue 20: the DiLoCo filter sat on one logger only)."""
    import logging

    from speedtronic.config import LoggingConfig
    from speedtronic.entrypoint import _configure_logging

    token = "tok-not-hf-shaped-1234567890"
    handler = _configure_logging(LoggingConfig(), secrets=(token, None))
    try:
        logging.getLogger("speedtronic.slots").warning("claimed with %s", token)
        logging.getLogger("speedtronic.diloco").error(f"refused: {token}")
    finally:
        logging.getLogger("speedtronic").removeHandler(handler)
    out = capsys.readouterr().out
    assert "claimed with <redacted>" in out and "refused: <redacted>" in out
    assert token not in out
