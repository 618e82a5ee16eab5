from django.apps import AppConfig


class MeteringConfig(AppConfig):
    name = "metering"
    label = "metering"
    verbose_name = "Metering"
