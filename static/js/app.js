// Small progressive enhancements; pages work without them.
document.addEventListener("change", (event) => {
  const target = event.target;
  if (target.matches("select[data-autosubmit]")) target.form.requestSubmit();
});

// <form data-confirm="Are you sure?">: ask before a destructive POST.
document.addEventListener("submit", (event) => {
  const message = event.target.dataset && event.target.dataset.confirm;
  if (message && !window.confirm(message)) event.preventDefault();
});

// <button data-copy="#selector">: copy that element's text (or an input's value).
document.addEventListener("click", async (event) => {
  const button = event.target.closest("[data-copy]");
  if (!button) return;
  const source = document.querySelector(button.dataset.copy);
  if (!source) return;
  const text = "value" in source && source.tagName === "INPUT" ? source.value : source.innerText;
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    // No clipboard API (plain http on a remote host): select the text so Ctrl+C works.
    if (source.select) source.select();
    else window.getSelection().selectAllChildren(source);
  }
  const label = button.textContent;
  button.textContent = "Copied";
  button.classList.add("copied");
  setTimeout(() => { button.textContent = label; button.classList.remove("copied"); }, 1500);
});

// CSRF for fetch() callers (the playground): the token Django rendered into the page.
window.inferplaneCsrfToken = () => document.querySelector('meta[name="csrf-token"]').content;
