// Small progressive enhancements; pages work without them.
document.addEventListener("change", (event) => {
  const target = event.target;
  if (target.matches("select[data-autosubmit]")) target.form.requestSubmit();
});
