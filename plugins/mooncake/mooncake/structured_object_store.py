"""Not served by tidekv's drop-in: importing it fails saying what to use instead."""

from tidekv.compat.mooncake_unserved import not_served

raise not_served(__name__)
