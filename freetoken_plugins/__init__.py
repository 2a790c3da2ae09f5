"""FreeToken's built-in plugins. Each module is one plugin, registered through the
``freetoken.plugins`` entry-point group exactly like a third party's."""
