"""Tool calling: OpenAI's ``tools`` / ``tool_choice`` as a plugin (``plugin.py``), the
tools in the chat template or a generic tool prompt (``prompting.py``), and incremental
tool-call parsers, one per model family (``parsers.py``)."""
