"""Names that reach the filesystem or a message: blob names from the index, file: URLs, redaction."""

from __future__ import annotations

import string

from hypothesis import given, settings
from hypothesis import strategies as st

from cachegen.store.local import blob_name_ok
from cachegen.store.url import redact

KEY = "ab" + "0123456789abcdef" * 3 + "0123456789abcd"


def test_blob_names():
    assert blob_name_ok(f"ab/{KEY}.3.0123abcd")
    assert blob_name_ok(f"ab/{KEY}.3.0123abcd", KEY, 3)
    assert not blob_name_ok(f"ab/{KEY}.3.0123abcd", KEY, 2)  # another level
    assert not blob_name_ok(f"ab/{KEY}.3.0123abcd", "ab" + "0" * 62)  # another chunk's file
    for bad in (
        f"cd/{KEY}.3.0123abcd",
        f"ab/{KEY}.3.0123abcd/x",
        f"../ab/{KEY}.3.0123abcd",
        f"ab/{KEY}.x.0123abcd",
        f"ab/{KEY.upper()}.3.0123abcd",
        f"/ab/{KEY}.3.0123abcd",
        "../../victim.txt",
        f"ab/{KEY}.3.0123abc",
        f"ab/{KEY}.3.0123abcd\n",
        "",
    ):
        assert not blob_name_ok(bad), bad


@settings(max_examples=500, deadline=None)
@given(st.text(alphabet=string.printable + "/.\\\x00é", max_size=120))
def test_no_accepted_blob_name_leaves_its_directory(name):
    if blob_name_ok(name):
        sub, _, file = name.partition("/")
        assert len(sub) == 2 and "/" not in file and ".." not in name and "\\" not in name and "\x00" not in name


@settings(max_examples=300, deadline=None)
@given(
    st.text(alphabet=string.ascii_letters + string.digits + "!$%^*()-_~@:", min_size=4, max_size=30),
    st.sampled_from(["redis", "redis+cluster", "rediss", "file", "http"]),
    st.sampled_from(["", "user"]),
)
def test_redact_hides_url_passwords(secret, scheme, user):
    secret = "SeKr1t" + secret  # never a part of the rest of the URL
    url = f"{scheme}://{user}:{secret}@host.example:6379/0?timeout=1"
    for text in (url, f"cannot connect to {url}: refused", repr(url), f"[{url}]"):
        out = redact(text)
        assert secret not in out and "***@host.example:6379/0" in out


@settings(max_examples=200, deadline=None)
@given(
    st.text(alphabet=string.ascii_letters + string.digits, min_size=4, max_size=30),
    st.sampled_from(["password", "token", "secret", "api_key", "apikey", "passwd"]),
)
def test_redact_hides_secret_query_parameters(secret, name):
    secret = "SeKr1t" + secret
    out = redact(f"redis://h:1/0?timeout=1&{name}={secret}&ttl=5")
    assert secret not in out and out.endswith("&ttl=5")
