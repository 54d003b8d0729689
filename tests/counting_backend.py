"""A store backend that counts the bytes it serves (every object opened whole, every range read), around any
other: how the tests measure what a restore reads from the store, not the product's own report."""
from __future__ import annotations


class CountingBackend:
    def __init__(self, inner):
        self._inner = inner
        self.bytes_served = 0
        self.objects_opened: list[str] = []

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def open_object(self, name, what):
        obj = self._inner.open_object(name, what)
        self.bytes_served += obj.size
        self.objects_opened.append(name)
        return obj

    def open_objects(self, wanted, what):
        opened = self._inner.open_objects(wanted, what)
        self.bytes_served += sum(obj.size for obj in opened)
        self.objects_opened += [obj.digest for obj in opened]
        return opened

    def read_object(self, name, offset, length):
        data = self._inner.read_object(name, offset, length)
        self.bytes_served += len(data)
        return data
