"""Staff's edit forms refuse to save over a change made since the page was shown.

A form of an existing object (the Django admin's change pages, the fleet page's pool form) carries what each of its
fields showed (Django's hidden initial, `initial-<field>`). On submit, each field whose stored value is no longer what
the page showed is refused, with the field: the page is out of date and the staff member reloads it. Before, the
admin's save sent every field as the page had shown it, and the services saved whatever differed from the row: an
organisation's owner lowered its spend cap from $500 to $50, staff with its page open since switched its billing mode,
and the cap was $500 again, audited as staff's change and told to nobody.

A submit without those values (a script, a test that posts the fields alone) is judged as before, against the row.

The comparison and the write are made under the row's lock (`LocksEditedRow`, the fleet page's pool form in its view):
two staff saves a few milliseconds apart both read the row before either wrote, both passed, and the second overwrote
the first. Now the second waits for the first's commit, reads what it wrote, and is refused.
"""

from __future__ import annotations

import re

from django import forms
from django.db import router, transaction
from django.utils.functional import cached_property

CHANGED_SINCE_SHOWN = ("Changed by someone else since this page was shown: reload the page to see what it holds now, "
                       "then make your change again.")


class RefusesStaleEdits:
    """A form mixin (before `forms.Form` or `forms.ModelForm` in the bases) for editing what exists: a model form's
    saved instance, or a plain form given its `initial` values. NOTE: a disabled field (a password's hash) never
    carries its value into the page."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        instance = getattr(self, "instance", None)
        self.edits_existing = instance.pk is not None if instance is not None else bool(self.initial)
        if self.edits_existing:
            for field in self.fields.values():
                field.show_hidden_initial = not field.disabled
            if self.is_bound:
                self._say_what_was_shown_empty()

    def _say_what_was_shown_empty(self) -> None:
        """NOTE: a submit that carries what its page showed carries it for every field, those shown empty too (a
        multiple choice with nothing chosen posts no hidden value). Without it, the page shown again for a mistake
        elsewhere claimed to have shown what staff had just chosen there, and its corrected save was refused as
        changed by someone else."""
        names = [bound.html_initial_name for _, bound in self._bound_items() if not bound.field.disabled]
        if not any(self._carries_initial(name) for name in names):
            return
        missing = [name for name in names if not self._carries_initial(name)]
        if missing:
            self.data = self.data.copy()
            for name in missing:
                if hasattr(self.data, "setlist"):  # a request's QueryDict
                    self.data.setlist(name, [])
                else:
                    self.data[name] = []

    @cached_property
    def changed_data(self) -> list[str]:
        """The fields whose value differs from the stored one (Django's with no hidden initials): what the services
        are given; what the page showed is judged apart (`clean`)."""
        return [name for name, bound in self._bound_items() if bound.field.has_changed(bound.initial, bound.data)]

    def clean(self):
        cleaned = super().clean()
        if self.edits_existing:
            for name in self.changed_since_shown():
                self.add_error(name, CHANGED_SINCE_SHOWN)
        return cleaned

    def changed_since_shown(self) -> list[str]:
        """The fields whose stored value is no longer what the submitted page showed; none when the submit says nothing
        of what it showed.

        NOTE: a page says it for every field once it says it for one: a multiple choice shown empty (no groups) posts
        no hidden value at all, and one chosen since was otherwise taken away unseen."""
        shown = [(name, bound) for name, bound in self._bound_items() if not bound.field.disabled]
        if not any(self._carries_initial(bound.html_initial_name) for _, bound in shown):
            return []
        return [name for name, bound in shown if self._shown_differs_from_stored(bound)]

    def _shown_differs_from_stored(self, bound) -> bool:
        """NOTE: the page's value as it would be shown now is compared first, as text: a field that folds what it is
        given (a username, NFKC) took the shown value of a row stored unfolded (an address from before sign-up folded
        it) for a change on every submit, and that account's page could never be saved, not even to deactivate it."""
        widget = bound.field.hidden_widget()
        shown = self._widget_data_value(widget, bound.html_initial_name)
        return (shown != widget.format_value(bound.field.prepare_value(bound.initial))
                and bound.field.has_changed(bound.initial, shown))

    def _carries_initial(self, html_initial_name: str) -> bool:
        """The submit holds the field's shown value (split widgets post `<name>_0`, `<name>_1`...)."""
        split = re.compile(rf"{re.escape(html_initial_name)}(_\d+)?")
        return any(split.fullmatch(key) for key in self.data)


class StaleEditsRefusedForm(RefusesStaleEdits, forms.ModelForm):
    """The Django admin's change form for a model whose admin has no form of its own (`ModelAdmin.form`)."""


class LocksEditedRow:
    """A `ModelAdmin` mixin (before `admin.ModelAdmin` in the bases): a change page's submit reads its row under the
    row's lock (FOR NO KEY UPDATE, as the services take a row they change), in the transaction Django's change view
    validates and saves in, so `RefusesStaleEdits` compares with what is stored and the save writes it, with no other
    save in between.

    NOTE: only the change page's submit, inside its transaction: a delete takes its rows in its own order
    (`UserAdmin.delete_queryset`), and a page shown locks nothing."""

    def get_object(self, request, object_id, from_field=None):
        obj = super().get_object(request, object_id, from_field)
        if obj is None or not self._saves_change_page(request):
            return obj
        # NOTE: read again under the lock: the row as the other save committed it, or None if it was deleted meanwhile.
        return self.get_queryset(request).select_for_update(no_key=True, of=("self",)).filter(pk=obj.pk).first()

    def _saves_change_page(self, request) -> bool:
        match = getattr(request, "resolver_match", None)
        return (request.method == "POST" and match is not None
                and match.url_name == f"{self.opts.app_label}_{self.opts.model_name}_change"
                and transaction.get_connection(router.db_for_write(self.model)).in_atomic_block)
