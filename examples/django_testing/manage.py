#!/usr/bin/env python
"""Django's manage.py, as startproject writes it."""

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "library.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
