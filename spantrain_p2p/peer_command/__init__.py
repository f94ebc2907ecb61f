"""``spantrain-peer``, the command that runs one peer, and the one declaration of the job options.

    main.py         the parser, the peer's config from the command line, the run loop, ``main``
    job_options.py  every option of the training job: its flag, type, default, help, the JobSpec or
                    TrainOptions field it sets, and which peers a launcher passes it to
"""
