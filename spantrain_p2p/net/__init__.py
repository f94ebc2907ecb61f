"""Data plane: framed messages over aiohttp, and (later) the link emulator and the prober."""
