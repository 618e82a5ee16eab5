from django.apps import AppConfig


class InventoryConfig(AppConfig):
    name = "inventory"
    verbose_name = "GPU inventory"

    def ready(self) -> None:
        from core.metrics import DATABASE_COLLECTORS
        from inventory.stranded import StrandedGangCollector

        DATABASE_COLLECTORS.append(StrandedGangCollector())
