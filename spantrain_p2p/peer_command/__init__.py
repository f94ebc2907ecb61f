"""``spantrain-peer``, the command that runs one peer.

    main.py         the parser, the peer's config from the command line, the run loop, ``main``
                    (the job's options are declared in ``job/options.py``, for the Python API too)
"""
