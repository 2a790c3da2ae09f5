"""Structured outputs: constrain generated text to a JSON schema, a regex, a list of choices or
a Lark grammar.

This package holds the grammar layer, independent of the engine: ``constraints`` (what a
client sends, validated into one ``Constraint``), ``backends`` (llguidance and xgrammar
behind one ``GrammarBackend`` / ``Matcher`` interface), ``compiler`` (compiling off the
request thread, cached and bounded in time) and ``mask`` (applying a token bitmask to the
logits, in torch or Triton).
"""
