"""Automatic prefix caching: whole KV pages shared by the sessions whose tokens begin alike (vLLM's, with exact
keys: parent page, tenant + version salt, tokens). Exact by batch invariance; docs/specdec.md. Pure Python."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Hashable, Sequence

Key = tuple[int, Hashable, tuple[int, ...]]  # (parent id, salt, the page's tokens)


class PrefixCache:
    def __init__(self, page_size: int):
        self.page_size = page_size
        self._ids = itertools.count(1)
        self._index: dict[Key, tuple[int, int]] = {}  # key -> (id, page)
        self._key: dict[int, Key] = {}  # cached page -> its key
        self._holders: dict[int, int] = {}  # cached page -> sessions holding it
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached pages nobody holds, least recent first

    @property
    def cached_pages(self) -> int:
        return len(self._key)

    @property
    def idle_pages(self) -> int:
        return len(self._idle)

    def _page_key(self, parent: int, salt: Hashable, tokens: Sequence[int], i: int) -> Key:
        return parent, salt, tuple(tokens[i * self.page_size: (i + 1) * self.page_size])

    def match(self, tokens: Sequence[int], salt: Hashable, max_pages: int) -> list[int]:
        """The cached pages of ``tokens``' longest cached prefix (at most ``max_pages``), each now held once more."""
        parent, found = 0, []
        for i in range(max(0, min(max_pages, len(tokens) // self.page_size))):
            hit = self._index.get(self._page_key(parent, salt, tokens, i))
            if hit is None:
                break
            parent, page = hit
            self._holders[page] += 1
            self._idle.pop(page, None)
            found.append(page)
        return found

    def add(self, pages: Sequence[int], tokens: Sequence[int], salt: Hashable) -> None:
        """Cache a session's pages under the tokens they hold (``tokens[i]`` at position ``i``; whole pages only); a
        page whose key is cached already under another page stays the session's own."""
        parent = 0
        for i in range(min(len(pages), len(tokens) // self.page_size)):
            key = self._page_key(parent, salt, tokens, i)
            hit = self._index.get(key)
            if hit is None:
                if pages[i] in self._key:  # cached under another prefix: not this one's page
                    return
                hit = (next(self._ids), pages[i])
                self._index[key], self._key[pages[i]], self._holders[pages[i]] = hit, key, 1
            parent = hit[0]

    def cached(self, page: int) -> bool:
        return page in self._key

    def release(self, page: int) -> bool:
        """A session lets go of ``page``; False if it is not cached (the caller frees it)."""
        if page not in self._key:
            return False
        self._holders[page] -= 1
        if self._holders[page] == 0:
            self._idle[page] = None
        return True

    def evict(self) -> int | None:
        """An idle page (the least recently released), no longer cached; None if none is idle."""
        if not self._idle:
            return None
        page, _ = self._idle.popitem(last=False)
        del self._index[self._key.pop(page)], self._holders[page]
        return page

    def stats(self) -> dict:
        return {"cached_pages": self.cached_pages, "idle_pages": self.idle_pages}

